"""What one run of the compression study measured and what theory predicts for it, as its tables use them
(tables.py): its point (architecture, compression), N and link, the steps it took to reach the target, its step
times by phase, its bytes per step (psarch's counters and the wire's), and the predicted step time."""
from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

from psarch.report.compare import convergence_of
from psarch.report.runs import Run, load_run, run_config
from psarch.theory import cluster_step, predict

# the targets, each a fraction of the initial gap of the workload's uncompressed ddp run at N = 4, picked from that
# run alone before any compressed run: the GPT's 10-step mean gap falls below 0.1 x its initial gap near step 41
# of 120, DLRM's below 0.75 x its initial gap near step 20 of 100 (it plateaus after)
TARGET = {"gpt": 0.1, "dlrm": 0.75}
WINDOW = 10   # steps in the trailing mean of the loss that is held against the target


def runs_in(folder: Path) -> list[Run]:
    found = []
    for f in sorted(folder.glob("*/summary.json")):
        try:
            found.append(load_run(f.parent))
        except ValueError as e:   # a failed point: said, and left out
            print(f"left out: {e}", file=sys.stderr)
    return found


def point(run: Run) -> tuple[str, str]:
    """(architecture, compression) of a run, as the tables name them."""
    t, b = run["config"]["train"], run["config"]["backend"]
    kind = b["kind"]
    if kind == "ps" and b.get("mode") == "geo":   # GEO: deltas both ways, a round every k_steps
        kind = f"ps geo k={b['k_steps']}{', barrier' if b.get('geo_barrier') else ''}"
    c = t.get("compression", "none")
    words = {"none": "none", "fp16": "fp16", "bf16": "bf16", "topk": f"top-k {t.get('topk_ratio')}",
             "powersgd": f"PowerSGD r={t.get('powersgd_rank')}"}[c]
    return kind, words


def world(run: Run) -> int:
    return int(run["summary"]["world_size"])


def link(run: Run) -> float:
    return float(run["config"]["cluster"]["link_mbps"])


def steps_to_target(steps_runs: list[Run], workload: str) -> tuple[float, dict[tuple[str, str, int], int | None]]:
    """The target gap and, per (architecture, compression, N), the steps its loopback run took to reach it."""
    base = next(r for r in steps_runs if point(r) == ("ddp", "none") and world(r) == 4)
    floor = base["summary"]["entropy_floor"]
    target = TARGET[workload] * (base["metrics"][0]["loss"] - floor)
    return target, {(*point(r), world(r)): convergence_of(r, target, window=WINDOW).steps for r in steps_runs}


def phases(run: Run) -> tuple[int, float | None, float]:
    """(warm-up steps, their median step time, the compressed steps' median): PowerSGD all-reduces whole for its
    first powersgd_warmup_steps; the run's own median (summary) is of steps after train.warmup_steps; GEO with
    k_steps > 1: the mean of the steps after train.warmup_steps, over whole rounds."""
    t = run["config"]["train"]
    measured = run["summary"]["cluster"]["step_time"]["measured_s"]
    if t.get("compression") != "powersgd":
        if round_steps(run) > 1:
            return 0, None, statistics.fmean(r["step_time_s"] for r in whole_rounds(run))
        return 0, None, measured
    warm = t["powersgd_warmup_steps"]
    times = [r["step_time_s"] for r in run["metrics"] if 3 <= r["step"] < warm]   # past the first 3, as the others
    return warm, statistics.median(times), measured


def round_steps(run: Run) -> int:
    """Steps between a worker's exchanges: k_steps in GEO, else 1."""
    b = run["config"]["backend"]
    return int(b.get("k_steps", 1)) if b.get("mode") == "geo" else 1


def whole_rounds(run: Run) -> list[dict]:
    """The metrics rows after train.warmup_steps, cut to whole rounds: GEO with k_steps > 1 computes k_steps - 1
    local steps and then exchanges, so its step time and bytes per step are means over rounds, not medians."""
    every = round_steps(run)
    rows = [r for r in run["metrics"] if r["step"] >= run["config"]["train"]["warmup_steps"]]
    return rows[:len(rows) // every * every]


def compressed_prediction(run: Run) -> dict:
    """Theory's figures for the run's compressed steps alone (PowerSGD without its warm-up)."""
    cfg = run_config(run)
    if cfg.train.compression == "powersgd":
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, powersgd_warmup_steps=0))
    return predict(cfg, run["summary"]["params"], run["summary"].get("frozen_params", 0)).to_dict()


def measured_bytes(run: Run) -> tuple[float, float]:
    """Bytes one worker sent and received per step, psarch's counters, over every step (PowerSGD: its compressed
    steps; GEO with k_steps > 1: whole rounds)."""
    t = run["config"]["train"]
    first = t["powersgd_warmup_steps"] if t.get("compression") == "powersgd" else 0
    rows = whole_rounds(run) if round_steps(run) > 1 else [r for r in run["metrics"] if r["step"] >= first]
    n = world(run)
    return (statistics.fmean(r["workers_sent"] for r in rows) / n, statistics.fmean(r["workers_received"] for r in rows) / n)


def wire_bytes(run: Run) -> float:
    """Bytes on a worker's interface per step (sent, headers included), mean over workers, over all the steps."""
    nodes = [n for n in run["summary"]["cluster"]["nodes"] if n["role"] == "worker"]
    return statistics.fmean(n["link_sent"] for n in nodes) / run["summary"]["steps"]


def predicted_step(run: Run, pred: dict) -> tuple[float, str]:
    """(seconds, how): the simulator's (this checkout's theory) where the backend writes a program, else "serial":
    compute + the busiest node's bytes / its link (not a bound: pushes from backward's hooks overlap compute)."""
    st = run["summary"]["cluster"]["step_time"]
    sim = cluster_step(run_config(run), run["summary"])["predicted_s"]
    if sim == sim:   # not nan
        return sim, "sim"
    # the busiest node of any role (a PS server where there are servers), either way
    busiest = max(max(n["sent"], n["received"]) for n in pred["nodes"].values())
    return st["compute_s"] + busiest * 8 / (link(run) * 1e6), "serial"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"
