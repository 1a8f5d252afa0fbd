"""What a server does to its parameter range: the update rules of the PS modes, without any sockets.

- sync: the mean of the N workers' gradients, one optimizer step (= DDP).
- async / ssp: one optimizer step per gradient as it arrives, optionally compensated for staleness τ:
  `lr`: learning rate / max(1, τ) (Zhang et al. 2016, "staleness-aware async SGD");
  `dc`: g + λ·g⊙g⊙(w_now − w_bak) (Zheng et al. 2017, DC-ASGD), where w_bak is the copy of the
  parameters this server last sent to that worker, kept per worker (N copies of the range, reported
  as server memory), exactly as the paper's server does.
- geo: the worker's delta is added to the parameters (no optimizer on the server). Workers divide
  their deltas by N (with train.compression a pull then sends each worker the compressed change since what it
  holds, deltas.py); after a worker was lost the server scales them by N / (workers whose deltas
  count), so the model still moves by the mean delta of the workers that are left (with the barrier:
  of the round's deltas; without: of the live workers), not by a fraction of it.

An update whose result would hold inf/nan (parameters or optimizer state) raises NonFiniteUpdate before it
changes anything (finite.py): finite pushes can overflow too.
"""
from __future__ import annotations

from collections import Counter

import torch

from psarch.config import Config
from psarch.meters import tensor_bytes
from psarch.precision import MixedPrecisionOptimizer
from psarch.ps.layout import push_dtype
from psarch.ps.messages import pulls_deltas
from psarch.ps.server.deltas import WorkerCopies
from psarch.ps.server.finite import StepProbe, sum_is_finite


class NonFiniteUpdate(ValueError):
    """An update not applied because its result would hold inf/nan; the range is unchanged."""


class RangeState:
    """A server's fp32 parameter range, the optimizer state for it, and its version (updates applied)."""

    def __init__(self, init: torch.Tensor, cfg: Config, workers: int) -> None:
        b = cfg.backend
        self.params = torch.nn.Parameter(init.detach().float().clone(), requires_grad=True)
        self.version = 0
        self.sent_version = [0] * workers    # the version last sent to each worker: pushes must name it
        self.mode, self.compensation, self.dc_lambda = b.mode, b.staleness_compensation, b.dc_lambda
        self.optim = None if b.mode == "geo" else MixedPrecisionOptimizer([self.params], cfg.train,
                                                                          cfg.train.precision)
        # sum of a round's gradients / deltas (barrier modes only; the first push of a round overwrites it)
        self.acc = torch.zeros_like(self.params.data) if b.barrier else torch.empty(0)
        self.backup = ([torch.zeros_like(self.params.data) for _ in range(workers)]
                       if b.mode in ("async", "ssp") and b.staleness_compensation == "dc" else None)
        # geo with compression: what each worker holds, so that a pull sends the compressed change (deltas.py)
        self.copies = (WorkerCopies(self.params.data, workers, push_dtype(cfg),
                                    cfg.train.topk_ratio if cfg.train.compression == "topk" else None, b.barrier)
                       if pulls_deltas(cfg) else None)
        self.staleness: Counter[int] = Counter()
        self.skipped = 0
        self.probe = StepProbe(self.optim.optimizer) if self.optim is not None else None

    @property
    def scale(self) -> float:
        return self.optim.scaler.scale if self.optim is not None else 1.0

    def _stepping(self) -> tuple[MixedPrecisionOptimizer, StepProbe]:
        """The optimizer and its probe, which every mode but geo (deltas added, no optimizer) has."""
        if self.optim is None or self.probe is None:
            raise RuntimeError(f"mode {self.mode}: this range has no optimizer (geo adds deltas)")
        return self.optim, self.probe

    def _step(self, grad: torch.Tensor, found_inf: bool) -> bool:
        optim, probe = self._stepping()
        if not found_inf and not probe.finite(grad, 1.0 / self.scale):
            raise NonFiniteUpdate("its update would make parameters or optimizer state non-finite")
        skipped = optim.step([grad], found_inf=found_inf)
        self.skipped += int(skipped)
        return skipped

    def apply_mean(self, workers: int, found_inf: bool) -> bool:
        """sync: one optimizer step on the mean of the round's summed gradients; returns skipped."""
        self.acc.div_(workers)   # (refused: the round is never applied, and the next one overwrites acc)
        skipped = self._step(self.acc, found_inf)
        self.version += 1
        return skipped

    def apply_sum(self, factor: float = 1.0) -> None:
        """geo with barrier: add the round's summed deltas (times `factor`)."""
        self._check_sum(self.acc, factor)
        with torch.no_grad():
            self.params.add_(self.acc, alpha=factor)
        self.version += 1

    def apply_delta(self, delta: torch.Tensor, staleness: int, factor: float = 1.0) -> None:
        """geo without barrier: add one worker's delta (times `factor`) at once."""
        self._check_sum(delta, factor)
        with torch.no_grad():
            self.params.add_(delta.float(), alpha=factor)
        self.staleness[staleness] += 1
        self.version += 1

    def _check_sum(self, delta: torch.Tensor, factor: float) -> None:
        if not sum_is_finite(self.params, delta, factor):
            raise NonFiniteUpdate("its update would make parameters non-finite")

    def apply_gradient(self, grad: torch.Tensor, staleness: int, worker: int, push_scale: float,
                       found_inf: bool) -> bool:
        """async/ssp: one optimizer step on one worker's gradient, compensated for its staleness."""
        g = grad.float() if grad.dtype != torch.float32 else grad
        if push_scale != self.scale and not found_inf:
            g = g * (self.scale / push_scale)  # the worker scaled its loss with an older loss scale
        if self.compensation == "dc" and not found_inf:
            assert self.backup is not None   # async/ssp with dc keep a backup per worker
            unscaled = g / self.scale
            # DC-ASGD: first-order Taylor correction of the gradient for the parameters' drift since the pull
            g = g + self.scale * self.dc_lambda * unscaled * unscaled * (self.params.data - self.backup[worker])
        group = self._stepping()[0].optimizer.param_groups[0]
        lr = group["lr"]
        if self.compensation == "lr":
            group["lr"] = lr / max(1, staleness)
        try:
            skipped = self._step(g, found_inf)
        finally:
            group["lr"] = lr
        self.staleness[staleness] += 1
        self.version += 1
        return skipped

    def remember_sent(self, worker: int) -> None:
        """This worker now computes its next gradient at the current version (dc: at these parameters)."""
        self.sent_version[worker] = self.version
        if self.backup is not None:
            self.backup[worker].copy_(self.params.data)

    def memory(self) -> dict[str, int]:
        """Bytes this range holds, by category (from the tensors)."""
        params = tensor_bytes([self.params])
        optim = self.optim.state_bytes() if self.optim is not None else 0
        buffers = tensor_bytes([self.acc] + (self.backup or [])) + (self.copies.nbytes if self.copies else 0)
        return {"params": params, "optimizer": optim, "buffers": buffers, "total": params + optim + buffers}
