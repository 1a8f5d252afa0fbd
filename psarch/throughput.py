"""Samples per second: one definition for the summary, `psarch compare`, the straggler tables and the progress
line. Workers in lockstep (every synchronous backend) finish each step together, so the global batch over the
median step time is the rate; workers at their own pace (async, SSP, GEO without barrier) do not wait for
each other, so the rate is the sum of each worker's own: its shard over its own median step time. Merging
them at the slowest worker's clock would make async look slower than sync under a straggler."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from psarch.records import MetricsRow, StepRecord

if TYPE_CHECKING:
    from psarch.config import Config

WorkerRow = StepRecord | MetricsRow   # a worker's own row: its StepRecord, or the merged row where it ran alone

LOCKSTEP = "global batch / median step time"
OWN_PACE = "sum over workers of shard / own median step time"
RANK_0 = "rank 0's shard / its median step time"   # the progress line of workers at their own pace


def warmup_steps(cfg: Config) -> int:
    """Steps left out of timing medians: train.warmup_steps, or min(5, steps // 5); at least one step is timed."""
    w = cfg.train.warmup_steps
    return min(5, cfg.train.steps // 5) if w < 0 else min(w, cfg.train.steps - 1)

def definition(lockstep: bool) -> str:
    """What samples/s means for a run, in the words every report and the progress line use."""
    return LOCKSTEP if lockstep else OWN_PACE


def per_worker(rows: Sequence[MetricsRow]) -> list[list[WorkerRow]]:
    """Each worker's own rows, in step order, from metrics.jsonl's merged rows (`workers[]`, or the row itself
    where one worker ran)."""
    workers: dict[int, list[WorkerRow]] = {}
    for r in rows:
        if "workers" in r:
            for w in r["workers"]:
                workers.setdefault(w.get("rank", 0), []).append(w)
        else:
            workers.setdefault(0, []).append(r)
    return [workers[k] for k in sorted(workers)]


def _median_time(rows: Sequence[WorkerRow], warmup: int) -> float:
    """Median step time after the first `warmup` rows (all rows where that would leave none)."""
    return statistics.median(r["step_time_s"] for r in (rows[warmup:] or rows))


def samples_per_s(rows: Sequence[MetricsRow], global_batch: int, lockstep: bool, warmup: int) -> float:
    """A run's samples/s from its merged metrics rows (each row's step_time_s the slowest worker's), leaving
    out the first `warmup` steps: definition(lockstep) says which rate."""
    if lockstep:
        return global_batch / _median_time(rows, warmup)
    workers = per_worker(rows)
    shard = global_batch / len(workers)
    return sum(shard / _median_time(w, warmup) for w in workers)
