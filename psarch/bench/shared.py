"""What every benchmark shares: trainers built as a run builds them, stepped by the runner's own StepLoop
(the same batch making and timing as every run's step times), several at once in turn so all see the same
machine load, and the runner's warm-up rule (psarch.launch.runner.warmup_steps) for what the medians leave out.

    loops = {label: trainer_loop(cfg, ctx) for label, cfg in configs.items()}
    times = interleaved({label: loop.timed for label, loop in loops.items()}, steps, warmup_steps(cfg))
"""
from __future__ import annotations

import statistics
from typing import Callable

from psarch.config import Config
from psarch.dist import DistContext
from psarch.launch.runner import StepLoop
from psarch.trainer import load_trainer
from psarch.workload import build_workload


def trainer_loop(cfg: Config, ctx: DistContext) -> StepLoop:
    """The config's workload and its backend's trainer on this rank, in the runner's StepLoop."""
    workload = build_workload(cfg)
    return StepLoop(load_trainer(cfg.backend.kind)(workload, cfg, ctx), workload, cfg, ctx)


def interleaved(runners: dict[str, Callable[[int], float]], steps: int, warmup: int) -> dict[str, list[float]]:
    """Each runner's step times: runner(step) takes step `step` and returns its seconds; they take each step
    in turn, the order rotating every step, and the first `warmup` steps are left out."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for step in range(steps):
        for name in names[step % len(names):] + names[:step % len(names)]:
            dt = runners[name](step)
            if step >= warmup:
                times[name].append(dt)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(v) for name, v in times.items()}
