"""Updates refused before they are applied when their result would not be finite.

A push may be finite and still overflow the update it drives (a gradient of 3e38: SGD's parameters reach inf in
a few pushes, AdamW's second moment at the first). The server decides before it changes anything, so a refused
update leaves the range bit-identical and nothing has to be rolled back:

- an optimizer step (`StepProbe`): when every parameter, state value and gradient is below SAFE in magnitude and
  the hyper-parameters are ordinary (`_ordinary`), no step of SGD, AdamW or Adagrad can leave fp32's range: each
  term of their updates is a sum of a few products of at most three such numbers or their bounded factors
  (g^2 <= 2^80; lr * m / ((1 - beta1) * eps) <= 2^10 * 2^41 * 2^30 * 2^40 = 2^121 < 2^128). That costs one
  min/max pass over them. Otherwise the same optimizer (class, hyper-parameters, fused kernel) is run on a copy
  of each chunk of the range, its state and its gradient: its kernels are element-wise, so each chunk's results
  are the real step's, at the cost of a second step and CHUNK elements of scratch per tensor;
- a sum (GEO's deltas, `sum_is_finite`): |p| + |f| |d| < 2^127 is finite; otherwise each chunk is added into
  scratch.
"""
from __future__ import annotations

import inspect
import math

import torch

CHUNK = 1 << 18   # elements per dry-run chunk: 1 MiB of scratch per tensor
SAFE = 2.0**40    # values below this (and ordinary hyper-parameters) cannot overflow one step


def absmax(t: torch.Tensor) -> float:
    """max |t| (nan if t holds one): one pass, no temporary the size of t. A floating tensor's is its inf-norm,
    one reduction (a server's round checks two or three tensors of each partition: half the torch calls of
    aminmax's, whose result still has to be negated and compared)."""
    if not t.numel():
        return 0.0
    if t.is_floating_point():
        return float(torch.linalg.vector_norm(t.detach(), math.inf))
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return float(torch.maximum(-lo, hi))


def _ordinary(group: dict) -> bool:
    """Hyper-parameters for which SAFE values cannot overflow a step: each number at most 2^10, eps at least
    2^-40, each beta at most 1 - 2^-30."""
    for key, value in group.items():
        if key == "params" or isinstance(value, bool):
            continue
        if key == "betas":
            if not all(0.0 <= b <= 1.0 - 2.0**-30 for b in value):
                return False
        elif key == "eps":
            if not 2.0**-40 <= value <= 2.0**10:
                return False
        elif isinstance(value, (int, float)) and not abs(value) <= 2.0**10:
            return False
    return True


class StepProbe:
    """Whether one step of `optimizer` (over one flat fp32 parameter, as a server's range has) would leave every
    parameter and every value of its state finite; the optimizer itself is not touched."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.real = optimizer
        self.target = optimizer.param_groups[0]["params"][0]
        size = min(CHUNK, self.target.numel())
        self.param = torch.nn.Parameter(torch.zeros(size))
        self.grad = self.param.grad = torch.zeros(size)   # the probe's gradient, filled chunk by chunk
        accepted = inspect.signature(type(optimizer).__init__).parameters
        self.probe = type(optimizer)([self.param], **{k: v for k, v in self._hyper().items() if k in accepted})
        self.scratch: dict[str, torch.Tensor] = {}

    def _hyper(self) -> dict:
        return {k: v for k, v in self.real.param_groups[0].items() if k != "params"}

    def finite(self, grad: torch.Tensor, inv_scale: float = 1.0) -> bool:
        """Would the step on `grad` (times inv_scale, as the optimizer will see it) keep everything finite?"""
        state = self.real.state.get(self.target, {})
        tensors = [self.target] + [v for v in state.values() if torch.is_tensor(v)]
        if _ordinary(self.real.param_groups[0]) and absmax(grad) * abs(inv_scale) < SAFE and all(
                absmax(t) < SAFE for t in tensors):
            return True
        return self._dry_run(state, grad, inv_scale)

    def _dry_run(self, state: dict, grad: torch.Tensor, inv_scale: float) -> bool:
        self.probe.param_groups[0].update(self._hyper())   # the caller may have changed lr for this step
        flat, g, n, size = self.target.detach().view(-1), grad.view(-1), self.target.numel(), self.param.numel()
        for lo in range(0, n, size):
            m = min(size, n - lo)
            with torch.no_grad():
                for dst, src in ((self.param, flat), (self.grad, g)):
                    dst[:m].copy_(src[lo:lo + m])
                    dst[m:].zero_()   # the tail of the last chunk: zeros step to zeros
                if inv_scale != 1.0:
                    self.grad.mul_(inv_scale)
            self.probe.state[self.param] = {k: self._chunk(k, v, lo, m) for k, v in state.items()}
            self.probe.step()
            after = [self.param] + [v for v in self.probe.state[self.param].values() if torch.is_tensor(v)]
            if not all(math.isfinite(absmax(t)) for t in after):
                return False
        return True

    def _chunk(self, key: str, value: object, lo: int, m: int) -> object:
        """The state `value` for elements [lo, lo + m), in scratch padded with zeros (a scalar: a copy)."""
        if not torch.is_tensor(value) or value.dim() == 0:
            return value.clone() if torch.is_tensor(value) else value
        out = self.scratch.setdefault(key, torch.zeros(self.param.numel(), dtype=value.dtype))
        out[:m].copy_(value.view(-1)[lo:lo + m])
        out[m:].zero_()
        return out


def sum_is_finite(base: torch.Tensor, other: torch.Tensor, alpha: float) -> bool:
    """Whether base + alpha * other (as `base.add_(other, alpha=alpha)` computes it) is finite everywhere."""
    if absmax(base) + abs(alpha) * absmax(other) < 2.0**127:
        return True
    scratch = torch.empty(min(CHUNK, base.numel()))
    b, o = base.detach().view(-1), other.view(-1)
    for lo in range(0, b.numel(), CHUNK):
        m = min(CHUNK, b.numel() - lo)
        torch.add(b[lo:lo + m], o[lo:lo + m].float(), alpha=alpha, out=scratch[:m])
        if not math.isfinite(absmax(scratch[:m])):
            return False
    return True
