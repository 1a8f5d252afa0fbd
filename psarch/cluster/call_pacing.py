"""A virtual device paced call by call: for a backend whose rank runs the loss function in parts, several
times a step (a pipeline stage runs only its own modules, on each of m micro-batches of b/m samples, a call
cut short at its stage's output or begun from a received activation; BackendSpec.paced_by_call).

psarch.cluster.pacing spreads the FLOPs of the whole model on the rank's whole batch (counted once) over
each call of the loss function: there, every micro-batch of every stage would be charged the whole step. Here
each call is charged its own FLOPs. The k-th call of a step is counted by torch's FlopCounterMode the first
time it runs (the first paced step: a backend paced by call runs the same calls, in the same order, every
step, as a pipeline's instruction list does), and from then on:
- forward: the call, once done (or cut short), waits until FLOPs / rate x factor x D has passed since it began;
- backward: from the moment its output's gradient arrives to the end of that backward, it waits until the
  call's forward FLOPs x (backward / forward FLOPs of the whole model, counted once) / rate x factor x D
  has passed. The backward's own FLOPs are not counted per call: the autograd engine runs it outside the call.
A call cut short hands its output on in the exception that ends it (its `output` attribute), so its backward
is paced too. No communication happens inside a call (a pipeline's transfers are instructions of their own),
so a call waits at its end alone, not spread through its modules.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from psarch.cluster.flops import FlopCount
from psarch.cluster.records import DeviceFacts, PacedFields


def _cpu_flash_attention(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


# The CPU's attention kernel, which FlopCounterMode's table lacks (on the meta device, where
# psarch.cluster.flops counts, attention decomposes into bmm's it does count): torch's own sdpa formula.
COUNTED_TOO = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention}


class CallDevice:
    """Paces each call of a rank's loss function (and its backward) by that call's own FLOPs."""

    def __init__(self, whole: FlopCount, flops_per_s: float, dilation: float, factor: Callable[[int], float]) -> None:
        self.backward_ratio = whole.backward / whole.forward if whole.forward else 2.0
        self.rate, self.dilation, self.factor = flops_per_s, dilation, factor
        self.waited: Callable[[], float] = lambda: 0.0   # set by the runner; no call waits on communication
        self.calls: list[int] = []         # forward FLOPs of the k-th call of a step, as counted
        self._step: int | None = None      # None before the first step: a trainer's set-up calls are not paced
        self._k = 0
        self.modelled_s = self.host_s = self.late_s = 0.0   # this step's, cluster time (host_s, late_s: wall)
        self.overran = False

    @property
    def step(self) -> int | None:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        """The runner sets it before each step: the step's calls start again from the first."""
        self._step, self._k = step, 0
        self.modelled_s = self.host_s = self.late_s = 0.0
        self.overran = False

    def wrap(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> Callable:
        def paced(model: nn.Module, batch: Any) -> torch.Tensor:
            if self._step is None:
                return loss_fn(model, batch)
            k, self._k = self._k, self._k + 1
            t0, m = time.perf_counter(), self.factor(self._step)
            try:
                out = self._call(k, loss_fn, model, batch)
            except Exception as e:   # cut short: the partial forward's output rides on the exception
                self._forward_ends(k, t0, m, getattr(e, "output", None))
                raise
            self._forward_ends(k, t0, m, out)
            return out
        return paced

    def _call(self, k: int, loss_fn: Callable, model: nn.Module, batch: Any) -> torch.Tensor:
        if k < len(self.calls):
            return loss_fn(model, batch)
        if k > len(self.calls):
            raise RuntimeError(f"virtual device: call {k} of step {self._step} before call {len(self.calls)} was "
                               f"counted; a backend paced by call must make the same calls every step")
        counter = FlopCounterMode(display=False, custom_mapping=COUNTED_TOO)
        try:
            with counter:
                return loss_fn(model, batch)
        finally:
            self.calls.append(counter.get_total_flops())

    def _forward_ends(self, k: int, t0: float, m: float, out: Any) -> None:
        self._wait(t0, self.calls[k] / self.rate * m)
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad: self._backward_starts(k, m))

    def _backward_starts(self, k: int, m: float) -> None:
        t0 = time.perf_counter()
        budget = self.calls[k] * self.backward_ratio / self.rate * m
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._wait(t0, budget))

    def _wait(self, t0: float, modelled: float) -> None:
        """Sleep until `modelled` seconds of cluster time (x D on this host) have passed since t0."""
        host = time.perf_counter() - t0
        deadline, budget = t0 + modelled * self.dilation, modelled * self.dilation
        self.modelled_s, self.host_s = self.modelled_s + modelled, self.host_s + host
        self.overran = self.overran or host > budget
        ahead = deadline - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)
        self.late_s += max(0.0, time.perf_counter() - deadline)

    @property
    def overrun(self) -> bool:
        """Whether a call of this step computed for longer than its modelled time x D."""
        return self.overran

    def fields(self) -> PacedFields:
        """The step record's: modelled compute, this machine's real compute, overrun, lateness (cluster time)."""
        return {"modelled_s": self.modelled_s, "host_s": self.host_s / self.dilation, "overrun": self.overran,
                "late_s": self.late_s / self.dilation}

    def facts(self) -> DeviceFacts:
        """FLOPs and nominal times per step (the sum of the step's calls; cluster time) and D."""
        forward = sum(self.calls)
        backward = int(forward * self.backward_ratio)
        return {"forward_flops": forward, "backward_flops": backward, "forward_s": forward / self.rate,
                "backward_s": backward / self.rate, "dilation": self.dilation, "paced": "by call"}

    def close(self) -> None:
        pass
