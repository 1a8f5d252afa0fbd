"""The analytic estimator reproduces the ZeRO paper (Rajbhandari et al. 2020), Tables 1 and 2, and BytePS's ratio
of a PS with a server per worker to the ring (its step times are the step simulator's).

The paper prints rounded, sometimes truncated, figures: each cell is checked to within 1 in its last
printed digit."""
from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import time

import pytest

from psarch.cli import main
from psarch.theory import estimate
from in_process import psarch_cli
from timing import scaled
from tiny import tiny

# Table 1: per-device model-state memory (GB) — baseline DDP, Pos, Pos+g, Pos+g+p — by DP degree.
TABLE1 = {
    7.5e9: {1: (120, 120, 120, 120), 4: (120, 52.5, 41.3, 30), 16: (120, 35.6, 21.6, 7.5),
            64: (120, 31.4, 16.6, 1.88), 256: (120, 30.4, 15.4, 0.47), 1024: (120, 30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048, 2048), 4: (2048, 896, 704, 512), 16: (2048, 608, 368, 128),
            64: (2048, 536, 284, 32), 256: (2048, 518, 263, 8), 1024: (2048, 513, 257, 2)},
    1e12: {1: (16000, 16000, 16000, 16000), 4: (16000, 7000, 5500, 4000), 16: (16000, 4750, 2875, 1000),
           64: (16000, 4187, 2218, 250), 256: (16000, 4046, 2054, 62.5), 1024: (16000, 4011, 2013, 15.6)},
}
# Table 2: largest model (parameters) for 32 GB V100s, DP = 64, by model-parallel degree.
TABLE2 = {1: ("2B", "7.6B", "14.4B", "128B"), 2: ("4B", "15.2B", "28.8B", "256B"),
          4: ("8B", "30.4B", "57.6B", "0.5T"), 8: ("16B", "60.8B", "115.2B", "1T"),
          16: ("32B", "121.6B", "230.4B", "2T")}


def last_digit(printed: float) -> float:
    """One unit in the last printed digit of a figure as the paper prints it."""
    text = f"{printed:g}"
    return 10.0 ** -len(text.split(".")[1]) if "." in text else 1.0


@pytest.mark.parametrize("phi", list(TABLE1))
def test_table1_every_cell(phi):
    rows = {r["world"]: r for r in estimate.memory_table(phi, list(TABLE1[phi]))}
    for world, cells in TABLE1[phi].items():
        for (name, _), paper in zip(estimate.STAGES, cells):
            ours = rows[world][name] / 1e9
            assert abs(ours - paper) <= last_digit(paper), f"Φ={phi:g} N={world} {name}: {ours} vs paper {paper}"


def test_table2_every_cell():
    rows = {r["mp"]: r for r in estimate.table2(32e9)}
    for mp, cells in TABLE2.items():
        for (name, _), printed in zip(estimate.STAGES, cells):
            scale, paper = {"B": 1e9, "T": 1e12}[printed[-1]], float(printed[:-1])
            ours = rows[mp][name] / scale
            assert abs(ours - paper) <= last_digit(paper), f"MP={mp} {name}: {ours:g} vs paper {printed}"
            assert abs(ours - paper) <= 0.025 * paper  # "1T" is 1.024T: the paper truncates


def test_step_times_by_formula():
    """With no compute and no latency the simulated steps are the bytes on the busiest link at its rate: the ring
    2(N-1)/N S, ZeRO-1/2 the same, ZeRO-3 3(N-1)/N S, one PS server N S in and N S out (pipelined: both at once,
    plus the last partition's pull from the server)."""
    from psarch.theory.estimate_steps import Network, scaling_table

    net = Network(bandwidth=1e9, alpha=0.0, compute_s=0.0)
    phi, s = 1e9 / 4, 1e9   # S = 1 GB in fp32
    rows = {r["world"]: r for r in scaling_table(phi, "fp32", net, [1, 4, 16], extra={"partition_mb": 1.0})}
    for n in (4, 16):
        assert rows[n]["ddp ring"] == pytest.approx(2 * (n - 1) / n * s / 1e9)
        assert rows[n]["zero-1"] == rows[n]["zero-2"] == pytest.approx(2 * (n - 1) / n * s / 1e9)
        assert rows[n]["zero-3"] == pytest.approx(3 * (n - 1) / n * s / 1e9)
        assert rows[n]["ps/1"] == pytest.approx((n * s + n * 2**20) / 1e9, rel=1e-6)
    assert rows[1]["ddp ring"] == 0.0


@pytest.mark.parametrize("n", [4, 8, 64, 1024])
def test_byteps_ratio_of_n_dedicated_servers_to_the_ring(n):
    """BytePS (Jiang et al., OSDI '20): with as many dedicated servers as workers, push and pull pipelined, the
    PS moves S each way per worker against the ring's 2(N-1)/N S, a ratio of N / (2(N-1)); no compute, no
    latency, partitions fine enough that draining the pipeline costs under 2%: 64 per server (the last one's
    pull is 1/64 of the exchange), of a Φ near 7.5B that splits evenly (1,788 x 2^22: every server alike)."""
    from psarch.theory.estimate_steps import RING, Network, architectures, config, simulated

    phi = 1788 * 2**22
    net = Network(bandwidth=12.5e9, alpha=0.0, compute_s=0.0)
    parts = {"partition_mb": phi * 2 / n / 64 / 2**20}
    ring, servers = (simulated(config(*architectures(1)[label], n, "bf16", net, parts), phi, net).step_s
                     for label in (RING, "ps/n"))
    assert servers / ring == pytest.approx(n / (2 * (n - 1)), rel=0.02)


def test_crossover_reads_the_table():
    """The PS with a server per worker moves S each way against the ring's 2(N-1)/N S: it overtakes the ring
    from N = 3 on, when compute hides neither; one server never does."""
    from psarch.theory.estimate_steps import Network, crossover, scaling_table

    rows = scaling_table(1e8, "bf16", Network(compute_s=0.0), [1, 2, 3, 4, 8])
    assert crossover(rows, "ps/n") == 3
    assert crossover(rows, "ps/1") is None


def estimate_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`psarch estimate ARGS` in this process (in_process.py); one call below runs as a command."""
    return psarch_cli(capsys, "estimate", *args)


@pytest.fixture(scope="module")
def at_64() -> tuple[int, str, str]:
    """`psarch estimate` at Φ = 7.5B, N = 64, p = 4, m = 8, once in this process (its step table takes seconds)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["estimate", "--params", "7.5e9", "--world", "64", "--pipeline", "4", "--microbatches", "8"])
    return code, out.getvalue(), err.getvalue()


def test_cli_estimate_prints_the_tables(capsys, at_64):
    """And it answers for Φ = 7.5B at N = 1,024 (step times to N = 1,024 simulated) within 10 s of an idle machine,
    as a command."""
    start = time.monotonic()
    big = subprocess.run([sys.executable, "-m", "psarch.cli", "estimate", "--params", "7.5e9", "--world", "1024"],
                         capture_output=True, text=True, timeout=scaled(60))
    assert big.returncode == 0, big.stderr
    assert time.monotonic() - start < scaled(10)
    assert "ps/n overtakes ring all-reduce at N = " in big.stdout
    code, out, err = at_64
    assert code == 0, err
    line = next(l for l in out.splitlines() if l.strip().startswith("64 ") and "<-" in l)
    assert line.split()[1:5] == ["120", "31.4", "16.6", "1.88"]
    code, _, err = estimate_cli(capsys, "--world", "4")
    assert code == 2 and "--params" in err


def test_cli_estimate_adds_pipeline_rows(capsys, at_64):
    """--pipeline p --microbatches m: p stages of Φ/p, (2 x 2 + K = 12) bytes per parameter in bf16 + AdamW; each
    stage's gradients ring all-reduced over dp = N / p; bubble (p-1)/(m+p-1), interleaved (v = 2) (p-1)/(v·m+p-1)."""
    code, out, err = at_64   # --params 7.5e9 --world 64 --pipeline 4 --microbatches 8
    assert code == 0, err
    rows = {l.split(" p=")[0].strip(): l.split()[-3:] for l in out.splitlines() if "pipeline " in l}
    states, sends = (4 + 12) * 7.5e9 / 4 / 1e9, 2 * 15 / 16 * 7.5e9 / 4 * 2 / 1e9
    assert rows["pipeline 1f1b"] == [f"{states:.3g}", f"{sends:.3g}", f"{3 / 11:.3f}"]
    assert rows["pipeline interleaved"][2] == f"{3 / 19:.3f}"
    code, _, err = estimate_cli(capsys, "--params", "1e9", "--world", "64", "--pipeline", "3")
    assert code == 2 and "--pipeline 3 must divide --world 64" in err


def test_tensor_parallel_rows_follow_megatron():
    """--tensor-parallel: at t = 1 plain data parallelism (all of Φ's states, one all-reduce of the gradients);
    at t = N one replica whose ranks hold Φ/t of the split matrices and all-reduce activations, 4 per block and
    2 more per step, plus the loss's all-gather; activations per psarch.activations. bf16 AdamW: 16 B per
    held parameter, 2-byte activations."""
    from psarch.theory.estimate_tensor import GPTShape, tensor_rows

    shape = GPTShape(layers=2, hidden=64, heads=4, seq=32, micro_batch=2, vocab=128)
    s, b, h, a, L, v = 32, 2, 64, 4, 2, 128
    phi = 2 * v * h + s * h + L * (12 * h * h + 13 * h) + 2 * h
    assert shape.params() == phi
    rows = {r["t"]: r for r in tensor_rows(shape, 4, "bf16", "adamw")}
    assert sorted(rows) == [1, 2, 4]
    assert rows[1]["states"] == pytest.approx(16 * phi)
    assert rows[1]["sent"] == pytest.approx(2 * 3 * -(-phi // 4) * 2)
    held = (2 * v * h + L * (12 * h * h + 7 * h)) / 4 + s * h + L * 6 * h + 2 * h
    assert rows[4]["states"] == pytest.approx(16 * held)
    assert rows[4]["sent"] == pytest.approx((4 * L + 2) * 2 * 3 * (s * b * h / 4) * 2 + 3 * 2 * s * b * 4)
    for t in (1, 4):
        per_block = s * b * h * (8 + 24 / t) + 8 * s * b + 4 * a * s * b / t
        assert rows[t]["activations"] == pytest.approx(L * per_block)


def test_cli_estimate_tensor_parallel_rows_and_their_errors(capsys):
    args = ["--params", "1e9", "--world", "8", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
            "--vocab", "128"]
    code, out, err = estimate_cli(capsys, *args, "--tensor-parallel", "2")
    assert code == 0, err
    assert "== tensor parallelism (Megatron) at N = 8: GPT 2 x 64, 4 heads" in out
    assert [line.split()[0] for line in out.splitlines() if line.endswith("<- --tensor-parallel")] == ["2"]
    code, _, err = estimate_cli(capsys, *args, "--tensor-parallel", "8")
    assert code == 2
    assert err.strip() == ("psarch: estimate: --tensor-parallel 8: must divide --world 8 and --heads 4 "
                                  "(and --heads must divide --hidden 64)")


def test_sizes_read_in_the_unit_of_their_magnitude_to_3_significant_figures():
    assert [estimate.fmt_size(x) for x in (0, 999, 63_232, 1.58e4, 2.5e6, 1.2e11, 3.2e13)] == \
        ["0 B", "999 B", "63.2 KB", "15.8 KB", "2.5 MB", "120 GB", "32 TB"]
    assert [estimate.fmt_time(t) for t in (9.5e-4, 0.0214, 3.0, 1e-5)] == ["950 us", "21.4 ms", "3 s", "10 us"]


def test_estimate_from_a_small_run_prints_its_own_units_and_no_billion_parameter_table(tmp_path, capsys):
    """A 3,952-parameter run: its tables in KB (not GB with 7 decimals), its times in ms, and no ZeRO Table 2
    for 32 GB devices unless a --budget asks for it."""
    (tmp_path / "tiny.toml").write_text(TINY_RUN)
    assert main(["run", str(tmp_path / "tiny.toml"), "--out", str(tmp_path / "tiny"), "--quiet"]) == 0
    est = ["--from", str(tmp_path / "tiny")]
    code, out, err = estimate_cli(capsys, *est)
    assert code == 0, err
    assert "== model states per device, KB: Φ = 3.952k" in out
    assert "== traffic per step at N = 1, KB (S = 15.8 KB of fp32 gradients)" in out
    assert "== step time (ms) simulated: compute " in out
    assert not re.search(r"\d\.\d{5,}|e-0\d", out), out     # no figure with 5+ decimals or an exponent
    assert "Table 2" not in out
    code, budget, err = estimate_cli(capsys, *est, "--budget", "80e9")
    assert code == 0, err
    assert "== largest model per device budget 80 GB, DP = 64 (ZeRO paper Table 2)" in budget


TINY_RUN = tiny(steps=4)


def test_estimate_simulates_the_gpts_pipelines_and_tensor_parallelism_beside_the_ring():
    """--pipeline and --tensor-parallel add the GPT's simulated steps at --world: each the simulator's step of
    that config's program, the ring's the same as the step-time table's for the GPT's Φ."""
    from psarch.theory.estimate_steps import Network, simulated
    from psarch.theory.estimate_tensor import GPTShape
    from psarch.theory.plan import config, simulated_step
    from psarch import theory

    gpt, net = GPTShape(layers=4, hidden=64, heads=4, seq=32, micro_batch=4, vocab=128), Network(1e9, 1e-5, 0.01)
    lines = estimate._model_parallel_steps(gpt, 8, "fp32", "adamw", {"stages": 2, "microbatches": 4}, 2, net)
    got = {line.split()[0]: line.split()[-6:] for line in lines[3:]}
    assert list(got) == ["ddp", "pipeline/gpipe", "pipeline/1f1b", "pipeline/interleaved", "tensor/t=2"]
    ring = simulated(theory.config_for("ddp", 8, "fp32", "adamw"), gpt.params(), net).step_s
    assert " ".join(got["ddp"][:2]) == estimate.fmt_time(ring)
    for label, backend in (("pipeline/1f1b", {"kind": "pipeline", "stages": 2, "microbatches": 4}),
                           ("tensor/t=2", {"kind": "tensor", "tensor_parallel": 2})):
        step = simulated_step(config(gpt, 8, "fp32", "adamw", backend), gpt.params(), 0.01, 1e9, 1e-5)
        assert step is not None and " ".join(got[label][:2]) == estimate.fmt_time(step[0].step_s)


def test_zero3s_simulated_step_gathers_the_units_of_the_gpt_asked_about():
    """The step-time table's ZeRO-3 gathers one unit per block and the root (embeddings and head) of the GPT given,
    the root's bytes its own; for Φ asked about alone, of a standard GPT of about Φ (GPT-3's width nearest it)."""
    import torch

    from psarch import registry
    from psarch.models.gpt import GPT
    from psarch.theory.estimate_steps import Network, config
    from psarch.theory.estimate_tensor import GPTShape, standard_shape
    from psarch.theory.program import DataStep, Transfer

    n = 64

    def gathers(workload: dict, phi: float) -> list[Transfer]:
        cfg = config("zero", {"stage": 3}, n, "bf16", Network(), None, workload)
        p = registry.spec_of(cfg).program(cfg, phi, DataStep.of(0.1), True)
        return [op for op in p.ops if isinstance(op, Transfer) and op.name.startswith("fag")]

    shape = GPTShape(layers=6, hidden=256, heads=4, seq=128, vocab=1000)
    got = gathers(shape.workload(), shape.params())
    assert len(got) == 6 + 1
    with torch.device("meta"):   # the root alone: a GPT of no block, built as psarch.models.gpt builds it
        root = sum(p.numel() for p in GPT(1000, 128, 0, 256, 4).parameters())
    assert got[0].bytes == pytest.approx(2 * root * (n - 1) / n)   # bf16; a ring moves (N-1)/N of it
    assumed = standard_shape(7.5e9)
    assert (assumed.hidden, assumed.heads) == (4096, 32) and assumed.params() == pytest.approx(7.5e9, rel=0.02)
    assert len(gathers(assumed.workload(), 7.5e9)) == assumed.layers + 1
    assert f"zero-3 gathers {assumed.layers + 1} units" in estimate._units(7.5e9, None, None)[1]
    assert "a GPT assumed for Φ" in estimate._units(7.5e9, None, None)[1]


def test_cli_estimate_of_a_gpt_shape_takes_its_units_and_its_params(capsys):
    """A GPT's shape without --params: Φ is the shape's, and the output names the units ZeRO-3 gathers."""
    from psarch.theory.estimate_tensor import GPTShape

    shape = ["--layers", "6", "--hidden", "256", "--heads", "4", "--seq-len", "128", "--vocab", "1000"]
    assert main(["estimate", *shape, "--world", "8"]) == 0
    out = capsys.readouterr().out
    phi = GPTShape(layers=6, hidden=256, heads=4, seq=128, vocab=1000).params()
    assert f"Φ = {estimate._params(phi)}, bf16" in out
    assert "zero-3 gathers 7 units, the root (embeddings, head) and 6 blocks of the GPT given" in out
    assert main(["estimate", "--layers", "0", "--world", "8"]) == 2
    assert "--layers" in capsys.readouterr().err


# ---------------------------------------------------------------- the hybrid (embeddings = "ps")

DLRM = {"model": "dlrm", "data": "clicks", "dlrm": {"num_tables": 4, "rows": 100_000, "dim": 16}}
HYBRIDS = (("ddp+ps/n", {"kind": "ddp"}), ("zero-3+ps/n", {"kind": "zero", "stage": 3}))


def _hybrid(backend: dict, n: int, per_rank: int):
    """The hybrid's own config at N = n: the tables on n servers beside the workers, the dense part by `backend`."""
    from psarch.config import from_dict

    return from_dict({"workload": DLRM, "train": {"precision": "fp32", "optimizer": "adamw",
                                                  "global_batch": per_rank * n},
                      "backend": {**backend, "world_size": n, "embeddings": "ps", "servers": n,
                                  "server_placement": "colocated", "overlap_comm": True}})


def test_the_hybrids_columns_are_the_simulators_step_of_its_config():
    """A model with embedding tables adds the hybrid's columns to the step-time table (ddp and ZeRO-3 over the dense
    part, the rows on a PS server beside each worker); each is the step simulator's for the hybrid's own config,
    played in full where that is small (N = 2, 8) and reduced at N = 64."""
    from psarch import registry
    from psarch.theory.estimate_steps import Network, scaling_table
    from psarch.theory.program import Cluster, DataStep
    from psarch.theory.simulate import simulate

    net, per_rank = Network(bandwidth=1.25e9, alpha=1e-5, compute_s=0.01), 32
    phi = 4 * 100_000 * 16 + 10_000   # the tables and some dense layers
    rows = {r["world"]: r for r in scaling_table(phi, "fp32", net, [2, 8, 64], workload=DLRM, per_rank=per_rank)}
    for n in (2, 8, 64):
        for label, backend in HYBRIDS:
            cfg = _hybrid(backend, n, per_rank)
            program = registry.spec_of(cfg).program(cfg, phi, DataStep.of(net.compute_s), n > 8)
            step = simulate(program, Cluster.of(program, net.bandwidth, net.alpha)).step_s
            assert rows[n][label] == pytest.approx(step, rel=1e-9), (n, label)
            assert rows[n][label] < rows[n]["ddp ring"]   # the rows it touches against the whole tables


def test_the_hybrid_is_ranked_with_its_memory_and_link_and_left_out_where_refused(tmp_path, capsys):
    """`estimate --from CONFIG.toml` of a DLRM: the hybrid ranked beside the others at the config's N, its memory a
    worker's model states plus its colocated server's share of the tables (theory.predict's), its link the busiest
    node's bytes in the program; in bf16, which the hybrid's rows refuse, it is left out in one line; a GPT has no
    tables and no hybrid."""
    from psarch import theory
    from psarch.theory.estimate import ranked
    from psarch.theory.estimate_steps import Network, config

    net = Network(compute_s=0.01)
    phi = 4 * 100_000 * 16 + 10_000
    got = {r["label"]: r for r in ranked(phi, 8, "fp32", "adamw", 1, net, None, DLRM, 32)}
    for label, backend in HYBRIDS:
        p = theory.predict(_hybrid(backend, 8, 32), phi)
        held = p.nodes["server"].memory.total   # colocated: a worker's device holds its server's share too
        assert held and got[label]["memory"] == pytest.approx(p.memory_per_rank.total + held)
        assert got[label]["link"] < got["ddp ring"]["link"] / 100
    assert [r["label"] for r in ranked(phi, 8, "fp32", "adamw", 1, net, None, DLRM, 32)][:2] == \
        sorted(["ddp+ps/n", "zero-3+ps/n"], key=lambda k: got[k]["step"])
    gpt = ranked(1e8, 8, "fp32", "adamw", 1, net)
    assert not any("+ps" in r["label"] for r in gpt) and len(gpt) == 7   # ring, ZeRO 1-3, ps/1, ps/n (col)
    assert config("ddp", {}, 8, "fp32", net, None, DLRM, 32).train.global_batch == 256

    toml = tmp_path / "dlrm.toml"
    toml.write_text('[workload]\nmodel = "dlrm"\ndata = "clicks"\n[workload.dlrm]\nrows = 100000\n'
                    '[train]\nglobal_batch = 256\nprecision = "{}"\n[backend]\nkind = "ddp"\nworld_size = 8\n')
    for precision in ("fp32", "bf16"):
        (tmp_path / f"{precision}.toml").write_text(toml.read_text().replace("{}", precision))
        code, out, err = estimate_cli(capsys, "--from", str(tmp_path / f"{precision}.toml"))
        assert code == 0, err
        assert "== at N = 8, ranked by simulated step" in out
        if precision == "fp32":
            assert "32 samples per worker" in out and " ddp+ps/n " in out and " zero-3+ps/n " in out
        else:
            assert "ddp+ps/n left out: backend.embeddings = \"ps\" with train.precision = \"bf16\"" in out
            assert " ddp+ps/n " not in out.split("left out")[-1]
