"""Stragglers' results, each worker at its own pace: samples/s and the wall-clock time to a target loss gap
for every run of a sweep folder. `python -m psarch.cluster.straggler_results runs/stragglers --target-gap G`
writes stragglers.md there. Times are the cluster's (on an emulated cluster of virtual devices, the wall
clock / D: every step record already holds them so).

`psarch compare` merges the workers' rows step by step, taking the slowest worker's time for each step:
right where workers wait for each other (sync, ring), but in asynchronous modes a fast worker does not
wait, so there the merged clock is the slow worker's and hides what asynchrony gains. Here every worker's
loss is placed at its own clock (the running sum of its step times) and the losses are read in time order.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from psarch import registry
from psarch.config import from_dict


def per_worker(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each worker's own rows, in step order, from metrics.jsonl's merged rows."""
    workers: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        for w in r.get("workers", [r]):
            workers.setdefault(w.get("rank", 0), []).append(w)
    return [workers[k] for k in sorted(workers)]


def samples_per_s(workers: list[list[dict[str, Any]]], global_batch: int) -> float:
    """Each worker's shard of the global batch over its own median step time, summed over workers."""
    shard = global_batch / len(workers)
    return sum(shard / statistics.median(r["step_time_s"] for r in w) for w in workers)


def events(workers: list[list[dict[str, Any]]]) -> list[tuple[float, float]]:
    """(time, loss) of every worker's every step, at the worker's own clock, in time order."""
    out = []
    for w in workers:
        clock = itertools.accumulate(r["step_time_s"] for r in w)
        out += [(t, r["loss"]) for t, r in zip(clock, w)]
    return sorted(out)


def time_to_gap(workers: list[list[dict[str, Any]]], floor: float, target: float, window: int = 10) -> float | None:
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


def final_gap(workers: list[list[dict[str, Any]]], floor: float, last: int = 20) -> float:
    """The mean of the last `last` x N losses in time order, less the entropy floor."""
    ev = events(workers)[-last * len(workers):]
    return statistics.fmean(loss for _, loss in ev) - floor


def rows(sweep: Path, target: float) -> list[dict[str, Any]]:
    """One row per finished run under `sweep`: its mode, slowdown, jitter and the three figures."""
    out = []
    for f in sorted(sweep.glob("*/summary.json")):
        s = json.loads(f.read_text())
        if s.get("status") != "finished" or s.get("entropy_floor") is None:
            continue
        cfg = from_dict(json.loads((f.parent / "config.json").read_text()))
        metrics = [json.loads(line) for line in (f.parent / "metrics.jsonl").read_text().splitlines()]
        workers, floor = per_worker(metrics), s["entropy_floor"]
        c, vd, step = cfg.cluster, s.get("virtual_device"), s.get("cluster", {}).get("step_time")
        spec = registry.spec_of(cfg)
        out.append({"mode": spec.label(cfg), "slowdown": c.slowdown, "jitter": c.jitter,
                    "samples_per_s": samples_per_s(workers, s["global_batch"]),
                    # lockstep: every step waits for the slowest worker; theory's step time says how long
                    "predicted": s["global_batch"] / step["predicted_s"] if step and spec.lockstep(cfg) else None,
                    "time_to_gap": time_to_gap(workers, floor, target), "final_gap": final_gap(workers, floor),
                    "dilation": vd["dilation"] if vd else None, "overrun": vd["overrun_fraction"] if vd else None})
    return sorted(out, key=lambda r: (r["jitter"], r["slowdown"], r["mode"]))


def _cell(x: float | None, form: str) -> str:
    return "" if x is None else format(x, form)


def table(rs: list[dict[str, Any]], target: float) -> str:
    """The markdown table; predicted samples/s for lockstep runs on an emulated cluster (the slowest
    worker's compute plus the step's communication), D and overrun steps for virtual devices."""
    lines = [f"| run | slowdown of worker 0 | jitter | samples/s | predicted (lockstep) | time to gap < {target:g} "
             f"(s) | final gap | D | overrun steps |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rs:
        t = f"{r['time_to_gap']:.1f}" if r["time_to_gap"] is not None else "not reached"
        lines.append(f"| {r['mode']} | {r['slowdown']:g}x | {r['jitter']:g} | {r['samples_per_s']:.0f} | "
                     f"{_cell(r['predicted'], '.0f')} | {t} | {r['final_gap']:.3f} | {_cell(r['dilation'], 'g')} | "
                     f"{_cell(r['overrun'], '.0%')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m psarch.cluster.straggler_results")
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--target-gap", type=float, default=0.25)
    a = ap.parse_args()
    if not a.sweep.is_dir():
        sys.exit(f"{a.sweep}: not a folder")
    if a.target_gap <= 0:
        sys.exit(f"--target-gap {a.target_gap:g}: must be > 0")
    found = rows(a.sweep, a.target_gap)
    if not found:
        sys.exit(f"{a.sweep}: no finished run with an entropy floor (summary.json) in it")
    (a.sweep / "stragglers.md").write_text(table(found, a.target_gap))
    print(table(found, a.target_gap), end="")
