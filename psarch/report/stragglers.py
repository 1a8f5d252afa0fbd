"""Stragglers' results, each worker at its own pace: samples/s and the wall-clock time to a target loss gap
for every run of a sweep folder. `psarch report stragglers runs/stragglers [--target-gap G]`
writes stragglers.md there (the target by default:
convergence_target x the workload's initial gap, psarch.report.runs.target_gaps).

samples/s is the one definition of psarch/throughput.py, as in the summary and `psarch compare`. For the
time to the target, `psarch compare` merges the workers' rows step by step, taking the slowest worker's time
for each step: right where workers wait for each other (sync, ring), but in asynchronous modes a fast worker
does not wait, so there the merged clock is the slow worker's and hides what asynchrony gains. Here every
worker's loss is placed at its own clock (the running sum of its step times) and the losses are read in time
order. Times are the cluster's (on an emulated cluster of virtual devices, the wall clock / D: every step
record already holds them so).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import TypedDict

from psarch import registry
from psarch.report.runs import load_run, publish, run_config, sweep_rows, target_gaps, target_words
from psarch.throughput import WorkerRow, per_worker


def events(workers: list[list[WorkerRow]]) -> list[tuple[float, float]]:
    """(time, loss) of every worker's every step, at the worker's own clock, in time order."""
    out = []
    for w in workers:
        clock = itertools.accumulate(r["step_time_s"] for r in w)
        out += [(t, r["loss"]) for t, r in zip(clock, w)]
    return sorted(out)


def time_to_gap(workers: list[list[WorkerRow]], floor: float, target: float, window: int = 10) -> float | None:
    """The first time the mean of the last `window` x N losses (N workers, in time order) is below
    floor + target; None if it never is."""
    k = window * len(workers)
    ev = events(workers)
    total = 0.0
    for i, (t, loss) in enumerate(ev):
        total += loss - (ev[i - k][1] if i >= k else 0.0)
        if i + 1 >= k and total / k - floor < target:
            return t
    return None


def final_gap(workers: list[list[WorkerRow]], floor: float, last: int = 20) -> float:
    """The mean of the last `last` x N losses in time order, less the entropy floor."""
    ev = events(workers)[-last * len(workers):]
    return statistics.fmean(loss for _, loss in ev) - floor


class StragglerRow(TypedDict):
    """One run of a stragglers sweep: its folder, mode, slowdown and jitter, and its figures."""

    run: str
    mode: str                    # the architecture's label
    slowdown: float
    jitter: float
    samples_per_s: float
    target_gap: float | None
    predicted: float | None      # theory's samples/s (lockstep runs on an emulated cluster)
    time_to_gap: float | None
    final_gap: float
    dilation: float | None
    overrun: float | None


def rows(sweep: Path, target: float | None = None) -> list[StragglerRow]:
    """One row per finished run under `sweep`: its folder's name, mode, slowdown, jitter and the three figures;
    the target gap `target`, else half of its workload's initial gap (psarch.report.runs.target_gaps)."""
    runs = []
    for f in sorted(sweep.glob("*/summary.json")):
        s = json.loads(f.read_text())
        if s.get("status") == "finished" and s.get("entropy_floor") is not None:
            runs.append(load_run(f.parent))   # samples/s as the summary and compare define it
    out: list[StragglerRow] = []
    for run, gap in zip(runs, target_gaps(runs, target)):
        s, cfg = run["summary"], run_config(run)
        workers, floor = per_worker(run["metrics"]), s["entropy_floor"]
        assert floor is not None   # only runs with a floor were loaded
        vd, step = s.get("virtual_device"), s.get("cluster", {}).get("step_time")
        out.append({"run": Path(run["path"]).name, "mode": s["label"], "slowdown": cfg.cluster.slowdown,
                    "jitter": cfg.cluster.jitter,
                    "samples_per_s": s["samples_per_s"], "target_gap": gap,
                    # lockstep: every step waits for the slowest worker; theory's step time says how long
                    "predicted": s["global_batch"] / step["predicted_s"]
                    if step and registry.spec_of(cfg).lockstep(cfg) else None,
                    "time_to_gap": time_to_gap(workers, floor, gap) if gap is not None else None,
                    "final_gap": final_gap(workers, floor),
                    "dilation": vd["dilation"] if vd else None, "overrun": vd["overrun_fraction"] if vd else None})
    return sorted(out, key=lambda r: (r["jitter"], r["slowdown"], r["mode"]))


def _cell(x: float | None, form: str) -> str:
    return "" if x is None else format(x, form)


def table(rs: list[StragglerRow], target: float | None = None) -> str:
    """stragglers.md's table: one row per run, the target stated in its head; predicted samples/s for
    lockstep runs on an emulated cluster (the slowest worker's compute plus the step's communication), D and
    overrun steps for virtual devices."""
    gaps = {r["target_gap"] for r in rs}
    words = target_words(target) + (f" = {gaps.pop():.3f}" if target is None and len(gaps) == 1 else "")
    lines = [f"| run | slowdown of worker 0 | jitter | samples/s | predicted (lockstep) | time to gap < {words} "
             f"(s) | final gap | D | overrun steps |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rs:
        t = f"{r['time_to_gap']:.1f}" if r["time_to_gap"] is not None else "not reached"
        lines.append(f"| {r['mode']} | {r['slowdown']:g}x | {r['jitter']:g} | {r['samples_per_s']:.0f} | "
                     f"{_cell(r['predicted'], '.0f')} | {t} | {r['final_gap']:.3f} | {_cell(r['dilation'], 'g')} | "
                     f"{_cell(r['overrun'], '.0%')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`psarch report stragglers SWEEP [--target-gap G]`: write stragglers.md in the sweep folder and print it."""
    ap = argparse.ArgumentParser(prog="psarch report stragglers", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--target-gap", type=float,
                    help="absolute target (default: convergence_target x the workload's initial gap)")
    a = ap.parse_args(argv)
    if a.target_gap is not None and a.target_gap <= 0:
        sys.exit(f"--target-gap {a.target_gap:g}: must be > 0")
    found = sweep_rows(a.sweep, lambda folder: rows(folder, a.target_gap),
                       "no finished run with an entropy floor (summary.json) in it")
    publish(a.sweep, "stragglers.md", table(found, a.target_gap))
    return 0
