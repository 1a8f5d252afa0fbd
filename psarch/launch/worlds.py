"""Each world a run's launcher starts (the first, and each one faults.restart = "replace" starts again): when it
was launched, when its first step began, its steps and its median step time, for summary.json's `worlds[]` and
failure_cost (each restart's start-up, measured; the first world's median step, a restart's predicted step).

A rank marks the moment its first step begins in ranks/rank<R>.began (CLOCK_MONOTONIC, one clock for every process
of this machine, as supervise's error records); a world's first step began when its last rank began it (no step
of a lockstep world can end before). Where faults.startup_s paces the start-up (psarch.cluster.startup), the mark
also says how late the rank was ready past the world's deadline."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import TypedDict



class World(TypedDict):
    """summary.json's `worlds[]` (seconds since the run's first world was launched, in the cluster's time, as
    faults' at_s)."""

    launched_at_s: float
    first_step: int | None           # the step it began with (a checkpoint's), None: no rank began one
    first_step_at_s: float | None    # when its last rank began that step
    steps: int                       # the steps it completed (the most of any rank)
    step_time_s: float | None        # its median step time (slowest rank's) after `warmup` steps of its own
    world_size: int                  # its backend.world_size (N, or less after faults.restart = "shrink")
    startup_late_s: float | None     # faults.startup_s: how late its last rank was ready past launch + startup_s
                                     # (> 0: a start-up overrun; 0: on time), None where the start-up is not paced


def mark_began(stream: Path, step: int, late_s: float | None = None) -> None:
    """A rank's mark, beside its metrics stream, that its first step (`step`) begins now; `late_s`: how late it was
    ready past its world's start-up deadline (wall seconds), where there is one."""
    stream.with_suffix(".began").write_text(json.dumps({"step": step, "at_ns": time.monotonic_ns(),
                                                        "late_s": late_s}) + "\n")


def since(t0: float, t: float, d: float) -> float:
    """Seconds from t0 to t (time.monotonic()) in the cluster's time (wall clock / dilation d)."""
    return round((t - t0) / d, 6)


def world(ranks: Path, launched_at_s: float, t0: float, d: float, warmup: int, world_size: int) -> World:
    """The record of the world of `world_size` ranks that just ended (or stopped), from its ranks' marks and metrics
    streams in the run folder's `ranks` (read before a restart clears them); t0: the run's time.monotonic() origin,
    d: its dilation."""
    marks = [json.loads(p.read_text()) for p in sorted(ranks.glob("rank*.began"))]
    first = min((m["step"] for m in marks), default=None)
    at_ns = max((m["at_ns"] for m in marks), default=None)
    late = [m["late_s"] for m in marks if m.get("late_s") is not None]
    per_step: dict[int, float] = {}
    for p in ranks.glob("rank*.jsonl"):
        for line in p.read_text().splitlines(keepends=True):
            if not line.endswith("\n"):   # a record cut short by a kill
                continue
            rec = json.loads(line)
            if first is not None and rec["step"] >= first:   # not the records a checkpoint carried
                per_step[rec["step"]] = max(per_step.get(rec["step"], 0.0), rec["step_time_s"])
    times = [per_step[s] for s in sorted(per_step)]
    timed = times[warmup:] or times
    return {"launched_at_s": launched_at_s, "first_step": first,
            "first_step_at_s": since(t0, at_ns / 1e9, d) if at_ns is not None else None,
            "steps": len(times), "step_time_s": statistics.median(timed) if timed else None, "world_size": world_size,
            "startup_late_s": round(max(late) / d, 6) if late else None}
