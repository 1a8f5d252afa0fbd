"""What a failure costs a run that restarts from its newest checkpoint: the steps done past that checkpoint are
done again (exact for a fault at a known step; on average over a uniformly random fault step)."""
from __future__ import annotations


def steps_lost(fault_step: int, checkpoint_every: int) -> int:
    """Steps done again after a fault as step `fault_step` begins: those past the newest checkpoint,
    fault_step − checkpoint_every·⌊fault_step / checkpoint_every⌋ (every step since 0 where there is none)."""
    if fault_step < 0:
        raise ValueError(f"fault step {fault_step}: expected a step >= 0")
    return fault_step % checkpoint_every if checkpoint_every > 0 else fault_step


def mean_steps_lost(checkpoint_every: int) -> float:
    """steps_lost averaged over a fault step drawn uniformly: (checkpoint_every − 1) / 2, half an interval."""
    if checkpoint_every <= 0:
        raise ValueError(f"checkpoint_every = {checkpoint_every}: expected a checkpoint interval > 0")
    return (checkpoint_every - 1) / 2


def time_lost(detection_s: float, startup_s: float, steps_lost: float, step_time_s: float) -> float:
    """Seconds a restart costs: the failure detected, the new world started up to its first step, and the steps
    past the checkpoint done again at the step time (detection + start-up + steps_lost · step time). The start-up
    is the cluster's where a run paces it (faults.startup_s), else the first world's as measured."""
    return detection_s + startup_s + steps_lost * step_time_s
