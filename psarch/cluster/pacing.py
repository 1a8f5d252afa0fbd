"""A virtual device's clock: a worker computes for real, then waits until the time its modelled device
would have reached, through forward and backward as the device would spend it.

Each phase (forward, backward) has a modelled wall-clock budget: its FLOPs / rate x m x D, m being the
step's straggler factor (slowdown x jitter, psarch.cluster.stragglers.factor) and D the dilation. The
phase's deadlines are spread where its FLOPs fall (psarch.cluster.flops):
- forward: before each module runs (a forward pre-hook), the worker waits until the start of the phase
  plus the budget's share of the FLOPs done before that module. ZeRO-3's gather of a unit (its own
  pre-hook, registered after this one) then waits only for what its prefetch, overlapping the modelled
  compute of the units before, has not yet brought, as on the device.
- backward: when a parameter's gradient is ready (a tensor hook, which runs before the gradient is
  accumulated and so before DDP's and ZeRO's post-accumulate hooks launch its bucket), the worker waits
  until the share of the backward's FLOPs done by then. A bucket is thus launched at the time the device
  would launch it, and its communication overlaps the rest of the modelled backward, not one sleep at the
  end (which would have every bucket launched at once, after the real, much shorter, backward).
- at the end of each phase, the worker waits for the rest of the budget.
Time a phase spends blocked on communication (Trainer.comm_waited_s: ZeRO's gathers and hook reductions)
is not compute: it moves every later deadline of the phase. So does the time of a backend's own work paced by the
device's WorkClock (`work`: a compression's, in a bucket's hook; psarch/cluster/work_pacing.py), which delays the
rest of backward as it would on the device.

A phase whose real compute (its time neither asleep here nor blocked on communication) exceeded its
budget overran: this machine, not the device, set its time; the step is counted as overrun. How late
each phase ended past its modelled end, for any reason (an overrun, or a wake-up the loaded machine
delayed), is recorded beside it (`late_s`).
Where a backend replaces the model's parameters (torch_fsdp's DTensors), their hooks never fire and the
backward's wait falls at its end.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from psarch.cluster.flops import FlopCount
from psarch.cluster.records import DeviceFacts, PacedFields
from psarch.cluster.work_pacing import WorkClock

# Inside a phase, the worker waits only where it is more than this share of the budget ahead: a launch at
# most 5% early, and a few wake-ups per phase rather than one per module (each costs a scheduling delay on
# a loaded machine).
PACE_AHEAD = 0.05


class Phase:
    """One phase's deadlines: started with its budget (wall seconds), then waited through at fractions."""

    def __init__(self, waited: Callable[[], float]) -> None:
        self.waited = waited
        self.active = False
        self.t0 = self.w0 = self.budget = self.slept = self.host = 0.0

    def start(self, budget: float) -> None:
        self.t0, self.w0, self.budget, self.active = time.perf_counter(), self.waited(), budget, True
        self.slept = 0.0

    def wait_until(self, fraction: float, least: float = 0.0) -> float:
        """Sleep until `fraction` of the budget (plus the phase's communication waits) has passed, if that is
        more than `least` of the budget away; returns how late the phase already was there (0 if it was not)."""
        deadline = self.t0 + fraction * self.budget + (self.waited() - self.w0)
        ahead = deadline - time.perf_counter()
        if ahead > least * self.budget:
            t = time.perf_counter()
            time.sleep(ahead)
            self.slept += time.perf_counter() - t
        return max(0.0, -ahead)

    def end(self) -> float:
        """Wait out the rest of the budget; how late the phase ended (wall seconds, 0 if on time). `host`:
        the phase's time neither asleep here nor blocked on communication: this machine's compute."""
        self.host = time.perf_counter() - self.t0 - self.slept - (self.waited() - self.w0)
        late = self.wait_until(1.0)
        self.active = False
        return late


class VirtualDevice:
    """Paces one worker's forward and backward to its modelled device (hooks on `model`)."""

    def __init__(self, model: nn.Module, flops: FlopCount, flops_per_s: float, dilation: float,
                 factor: Callable[[int], float], work: WorkClock | None = None) -> None:
        self.forward_s, self.backward_s = flops.forward / flops_per_s, flops.backward / flops_per_s   # cluster time
        self.flops, self.dilation, self.factor = flops, dilation, factor
        self.step = 0                  # set by the runner: this step's straggler factor is drawn for it
        self.waited: Callable[[], float] = lambda: 0.0   # the trainer's comm_waited_s, once it is built
        self.modelled_s = 0.0          # this step's modelled compute, cluster time (the factor included)
        self.late = [0.0, 0.0]         # wall seconds its forward and backward ended after their modelled end
        # the backend's own work (a compression's) at the device's rates; None: priced at nothing
        self.work = work or WorkClock(0.0, 0.0, dilation)
        self.fwd, self.bwd = Phase(self._not_compute), Phase(self._not_compute)
        # 0: the phase's start. A gradient ready at 1, the end of backward, still waits in its hook: the bucket
        # its post-accumulate hook launches must not leave before the modelled backward is over.
        self._handles = [m.register_forward_pre_hook(self._at(self.fwd, f))
                         for m, f in zip(model.modules(), flops.module_marks) if f]
        self._handles += [p.register_hook(self._at(self.bwd, f))
                          for p, f in zip(model.parameters(), flops.param_marks) if f and p.requires_grad]

    def _not_compute(self) -> float:
        """Wall seconds so far not the model's compute: blocked on communication, or in the backend's paced work."""
        return self.waited() + self.work.spent_s

    def _at(self, phase: Phase, fraction: float) -> Callable:
        def hook(*args: Any) -> None:
            if phase.active:
                phase.wait_until(fraction, PACE_AHEAD)
        return hook

    def wrap(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> Callable:
        def paced(model: nn.Module, batch: Any) -> torch.Tensor:
            m = self.factor(self.step)
            self.modelled_s, self.late, self.bwd.host = (self.forward_s + self.backward_s) * m, [0.0, 0.0], 0.0
            self.work.new_step()
            self.fwd.start(self.forward_s * m * self.dilation)
            loss = loss_fn(model, batch)
            self.late[0] = self.fwd.end()
            if loss.requires_grad:
                loss.register_hook(lambda grad: self._backward_starts(m))
            return loss
        return paced

    def _backward_starts(self, m: float) -> None:
        self.bwd.start(self.backward_s * m * self.dilation)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self) -> None:
        self.late[1] = self.bwd.end()

    @property
    def overrun(self) -> bool:
        """Whether this step's forward or backward (or a piece of the backend's paced work) computed for longer than
        its modelled time x D."""
        return any(p.host > p.budget for p in (self.fwd, self.bwd)) or self.work.overran

    def fields(self) -> PacedFields:
        """What the step record carries, in cluster time: the step's modelled compute, this machine's real
        compute beside it, whether either phase's exceeded its modelled time, and how late they ended; the
        backend's paced work apart (`work_s`, at the device's rates; not in modelled_s, which is the model's)."""
        return {"modelled_s": self.modelled_s, "host_s": (self.fwd.host + self.bwd.host) / self.dilation,
                "overrun": self.overrun, "late_s": sum(self.late) / self.dilation, "work_s": self.work.modelled_s}

    def facts(self) -> DeviceFacts:
        """The device's per-step facts for the rank's record: FLOPs, nominal times (cluster time) and D."""
        return {"forward_flops": self.flops.forward, "backward_flops": self.flops.backward,
                "forward_s": self.forward_s, "backward_s": self.backward_s, "dilation": self.dilation}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
