"""`psarch compare`'s tables from runs made by hand, without training: the convergence table's target (relative to
each workload's start, or the config's convergence_target) and the per-rank and links rows of model-parallel
runs."""
from __future__ import annotations

import pytest


def fake_dlrm(name: str, losses: list[float], floor: float | None, lockstep: bool = True, **config) -> dict:
    """A run as compare holds it: a dlrm-like workload's losses, 0.5 s a step."""
    return {"run_label": name, "config": {"workload": {"model": "dlrm"}, **config},
            "summary": {"world_size": 2, "entropy_floor": floor, "workload": "dlrm/clicks", "lockstep": lockstep,
                        "label": "ddp ring"},
            "metrics": [{"step": i, "loss": v, "step_time_s": 0.5} for i, v in enumerate(losses)]}


def test_the_convergence_target_is_relative_to_each_workloads_start_unless_given():
    """A workload whose initial gap is 0.24 (dlrm's) reaches an absolute 0.25 at step 1; by default its target
    is convergence_target's 0.1 of its initial gap, one for every run of it. A run without a floor is named."""
    from psarch.report.compare import convergence

    def fake(name: str, losses: list[float], floor: float | None, lockstep: bool = True) -> dict:
        return {"run_label": name, "config": {"workload": {"model": "dlrm"}},
                "summary": {"world_size": 2, "entropy_floor": floor, "workload": "dlrm/clicks", "lockstep": lockstep},
                "metrics": [{"step": i, "loss": v, "step_time_s": 0.5} for i, v in enumerate(losses)]}
    falling = [0.66 - 0.01 * i for i in range(30)]
    runs = [fake("async", [0.64] + falling[1:], 0.42, lockstep=False), fake("ring", falling, 0.42),
            fake("mine", falling, None)]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in convergence(runs).splitlines()[2:]}
    # ring's first loss sets the target for both: 0.1 x (0.66 - 0.42) = 0.024; the 10-step mean gap after index
    # k >= 9 is 0.24 - 0.01 (k - 4.5), first below 0.024 at k = 27: step 28, 28 x 0.5 s
    assert rows["ring"][3] == rows["async"][3] == "0.0240" and rows["ring"][4] == "28" and rows["ring"][5] == "14.00"
    assert rows["mine"][2] == "no entropy floor"
    absolute = {line.split(" | ")[0][2:]: line.split(" | ") for line in convergence(runs, 0.25).splitlines()[2:]}
    assert absolute["ring"][3] == "0.2500" and absolute["ring"][4] == "1"


def test_the_config_key_convergence_target_sets_the_reports_target():
    """convergence_target = 0.25: a quarter of the initial gap, 0.06, which the 10-step mean gap
    0.24 - 0.01 (k - 4.5) first falls below at k = 23 (step 24); the words under the table say which fraction; runs that set
    another are named as not comparable."""
    from psarch.report.compare import convergence, comparability_warnings
    from psarch.config import ConfigError, from_dict
    from psarch.report.runs import target_words

    assert from_dict({"convergence_target": 0.5}).convergence_target == 0.5
    with pytest.raises(ConfigError, match="convergence_target = 0.0: must be >= 0.001"):
        from_dict({"convergence_target": 0.0})
    falling = [0.66 - 0.01 * i for i in range(30)]
    runs = [fake_dlrm("ring", falling, 0.42, convergence_target=0.25), fake_dlrm("ddp", falling, 0.42)]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in convergence(runs).splitlines()[2:]}
    assert rows["ring"][3] == rows["ddp"][3] == "0.0600" and rows["ring"][4] == "24" and rows["ring"][5] == "12.00"
    assert target_words(None, 0.25) == "0.25 x the workload's initial gap"
    assert any("convergence_target: 0.1 vs 0.25" in w for w in comparability_warnings(runs))


def test_compare_shows_per_rank_figures_and_links_of_model_parallel_runs():
    """A tensor run (theory's per_rank: each shard's blocks' activations) and a pipeline run (each stage's idle
    fraction and activations held) get a row per rank, every figure measured beside predicted, and one links row
    each, bytes by operation (set-up and export left out); a ddp run, which predicts nothing per rank, none."""
    from psarch.report.links import links_table
    from psarch.report.ranks import has_per_rank, rank_table

    def run(name, label, figures, extra, ops):
        per_rank = [{"memory": {"total": 4096.0}, "sent": 2048.0, "received": 2048.0, **f} for f in figures]
        summary = {"name": name, "label": label, "world_size": 2, "steps": 4, "extra": extra,
                   "predicted": {"traffic_per_step": {"worker_sent": 2048}, "memory_per_rank": {"total": 4096.0},
                                 **({"per_rank": per_rank} if figures else {})},
                   "memory": {"per_rank": [{"rank": r, "total": 4096} for r in range(2)]},
                   "traffic": {"per_rank": [{"sent_per_step": 2048, "received_per_step": 2048, "modelled": False,
                                             "ops": ops}] * 2}}
        return {"run_label": f"runs/{name}", "summary": summary}

    ops = {"tp_all_reduce": {"sent": 4 * 2000}, "tp_all_gather": {"sent": 4 * 48},
           "export_tp_all_gather": {"sent": 999}}
    tensor = run("tp", "tensor t=2 ring", [{"block_activation_bytes": 3072.0}] * 2,
                 {"block_activation_bytes": [3072, 3000]}, ops)
    pipe = run("pp", "pipeline gpipe p=2", [{"stage": 0, "idle_fraction": 0.5, "activations_held": 1024.0},
                                            {"stage": 1, "idle_fraction": 0.5, "activations_held": 2048.0}],
               {"idle_fraction": [0.52, 0.49], "activations_held": [1024, 2048]}, {"p2p": {"sent": 4 * 2048}})
    ddp = run("dp", "ddp ring", [], {}, {"all_reduce": {"sent": 8192}})
    ranked = [r for r in (tensor, pipe, ddp) if has_per_rank(r)]
    assert ranked == [tensor, pipe]
    rows = rank_table(ranked).splitlines()
    assert rows[0].endswith("| block activation bytes measured \\| predicted | idle fraction measured \\| "
                            "predicted | activations held measured \\| predicted |"), rows[0]
    same = "4.00 KiB \\| 4.00 KiB | 2.00 KiB \\| 2.00 KiB | 2.00 KiB \\| 2.00 KiB"
    assert rows[2:] == [f"| runs/tp | tensor t=2 ring | 0 | {same} | 3.00 KiB \\| 3.00 KiB | - \\| - | - \\| - |",
                        f"| runs/tp | tensor t=2 ring | 1 | {same} | 2.93 KiB \\| 3.00 KiB | - \\| - | - \\| - |",
                        f"| runs/pp | pipeline gpipe p=2 | 0 | {same} | - \\| - | 52.0% \\| 50.0% | "
                        "1.00 KiB \\| 1.00 KiB |",
                        f"| runs/pp | pipeline gpipe p=2 | 1 | {same} | - \\| - | 49.0% \\| 50.0% | "
                        "2.00 KiB \\| 2.00 KiB |"]
    assert links_table(ranked).splitlines()[2:] == [
        "| runs/tp | tensor t=2 ring | 2 | 2.00 KiB \\| 2.00 KiB | tp_all_reduce 1.95 KiB, tp_all_gather 48 B |",
        "| runs/pp | pipeline gpipe p=2 | 2 | 2.00 KiB \\| 2.00 KiB | p2p 2.00 KiB |"]
