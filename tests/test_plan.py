"""`psarch estimate --plan` (psarch/theory/plan.py): its ranking is the simulator's step times, fitting candidates
first; its memory is theory's, and its fit flags say whether that memory is within the device's; its check
commands are valid configs of the best candidates."""
from __future__ import annotations

from pathlib import Path

import pytest

from psarch import registry, theory
from psarch.activations import block_activation_bytes
from psarch.cluster.device import MEMORY_GB
from psarch.config import load_config
from psarch.theory.estimate_tensor import GPTShape
from psarch.theory.plan import Hardware, activations, check_overrides, config, plan, report, sent_per_node
from psarch.theory.program import Cluster, DataStep
from psarch.theory.simulate import simulate

SHAPE = GPTShape(layers=16, hidden=4096, heads=32, seq=1024, micro_batch=16, vocab=50257)   # 3.6B: DDP does not fit
HW = Hardware("h100", 0.4, 50e9, 10e-6)
WORLD = 16


@pytest.fixture(scope="module")
def rows():
    return plan(SHAPE, WORLD, HW)


def test_ranked_by_step_time_fitting_first_and_every_kind_present(rows):
    keys = [(not r.fits, r.step_s) for r in rows]
    assert keys == sorted(keys)
    kinds = {r.backend["kind"] for r in rows}
    assert kinds == {"ddp", "zero", "ps", "pipeline", "tensor"}
    assert any(r.fits for r in rows) and not all(r.fits for r in rows)


def test_each_row_is_its_configs_simulated_step_and_theorys_memory(rows):
    phi, limit = SHAPE.params(), MEMORY_GB["h100"] * 1e9
    for r in rows:
        cfg = config(SHAPE, WORLD, "bf16", "adamw", r.backend)
        p = theory.predict(cfg, phi)
        acts = activations(cfg, p)
        extra = p.nodes["server"].memory.total if r.backend.get("server_placement") == "colocated" else 0.0
        assert r.memory == pytest.approx(p.memory_per_rank.total + acts + extra)
        assert r.fits == (r.memory <= limit), r.label
        if r.backend["kind"] == "ddp":   # every block's activations on its 16 sequences
            assert acts == pytest.approx(SHAPE.layers * block_activation_bytes(1024, 16, 4096, 32, 2))
        # every device computes 6Φ FLOPs per token of its share of the global batch
        step = DataStep.of(6 * phi * cfg.train.global_batch / WORLD * SHAPE.seq / HW.flops("bf16"))
        program = registry.spec_of(cfg).program(cfg, phi, step, True)
        assert r.step_s == pytest.approx(simulate(program, Cluster.of(program, HW.bandwidth, HW.alpha)).step_s)
        assert r.link == pytest.approx(max(sent_per_node(program)))
        if r.backend["kind"] in ("ddp", "zero", "tensor"):   # the program sends what theory counts
            assert r.link == pytest.approx(p.link.sent, rel=1e-3), r.label


def test_report_prints_the_ranking_and_checks_the_best_fitting(rows):
    text = report(SHAPE, WORLD, HW)
    table = [line for line in text.splitlines() if line[:3].strip().isdigit()]
    assert [line.split(None, 1)[1].startswith(r.label) for line, r in zip(table, rows)] == [True] * len(rows)
    commands = [line for line in text.splitlines() if line.startswith("psarch run")]
    best = [r for r in rows if r.fits][:3]
    assert len(commands) == len(best)
    quickstart = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.toml"
    for r, line in zip(best, commands):
        assert f"backend.kind=\"{r.backend['kind']}\"" in line
        cfg = load_config(quickstart, check_overrides(r, SHAPE, HW, "bf16"))   # a config psarch run accepts
        assert cfg.backend.kind == r.backend["kind"] and cfg.backend.world_size == 8 and cfg.cluster.emulate


DLRM_TOML = """
name = "ctr"
[workload]
model = "dlrm"
data = "clicks"
[workload.dlrm]
num_tables = 4
rows = 200000
dim = 64
[train]
global_batch = 2048
optimizer = "adagrad"
lr = 0.05
[backend]
kind = "ddp"
world_size = 4
"""


def test_a_model_with_embedding_tables_adds_the_hybrid_through_the_same_programs(tmp_path, rows):
    """--plan --from a DLRM's config: the hybrid (ddp and ZeRO-3 over the dense layers, the tables' rows on a PS
    server colocated with each worker) is ranked among the other candidates, its step its own config's program
    simulated, its memory theory's (the colocated server's tables included), its check command a config psarch run
    accepts; a GPT's plan has no hybrid, and the DLRM's no pipeline or tensor parallelism."""
    from psarch.theory.plan import ConfigModel

    path = tmp_path / "ctr.toml"
    path.write_text(DLRM_TOML)
    asked = load_config(path)
    model = ConfigModel(asked.to_dict()["workload"], 2048 // 4, str(path))
    assert not any(r.backend.get("embeddings") for r in rows)   # the GPT's plan
    rows = plan(model, WORLD, HW, "fp32", "adagrad")
    hybrids = [r for r in rows if r.backend.get("embeddings") == "ps"]
    assert sorted((r.backend["kind"], r.backend.get("stage")) for r in hybrids) == [("ddp", None), ("zero", 3)]
    assert {r.backend["kind"] for r in rows} == {"ddp", "zero", "ps"}
    phi = model.params()
    dense = phi - theory.table_params(asked)
    for r in rows:
        cfg = config(model, WORLD, "fp32", "adagrad", r.backend)
        program = registry.spec_of(cfg).program(cfg, phi, DataStep.of(6 * dense * 512 / HW.flops("fp32")), True)
        assert r.step_s == pytest.approx(simulate(program, Cluster.of(program, HW.bandwidth, HW.alpha)).step_s)
        assert r.link == pytest.approx(max(sent_per_node(program)))
        p = theory.predict(cfg, phi)
        assert r.memory == pytest.approx(p.device_memory())   # a DLRM's activations left out: plan.activations
    # the dense layers alone move in the hybrid: its busiest link sends less than ddp's, which all-reduces the tables
    link = {(r.backend["kind"], r.backend.get("embeddings")): r.link for r in rows}
    assert link[("ddp", "ps")] < link[("ddp", None)] / 10
    text = report(model, WORLD, HW, "fp32", "adagrad")
    assert "ddp + tables on ps/n colocated" in text and "zero-3 + tables on ps/n colocated" in text
    for line in [x for x in text.splitlines() if x.startswith("psarch run")]:
        assert line.startswith(f"psarch run {path} ")
        sets = [s.strip("'") for s in line.split("--set ")[1:]]
        assert load_config(path, [s.strip().strip("'") for s in sets]).backend.world_size == 8


def test_the_plan_takes_a_config_file_not_a_run_folder_nor_a_shape_beside_it(tmp_path, capsys):
    from psarch.cli import main

    path = tmp_path / "ctr.toml"
    path.write_text(DLRM_TOML)
    assert main(["estimate", "--plan", "--from", str(path), "--world", "4"]) == 0
    assert "ddp + tables on ps/n colocated" in capsys.readouterr().out
    assert main(["estimate", "--plan", "--from", str(path), "--layers", "4"]) == 2
    assert main(["estimate", "--plan", "--from", str(tmp_path)]) == 2
    assert "a config file (.toml)" in capsys.readouterr().err
