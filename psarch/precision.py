"""Mixed precision shared by every backend: compute dtype, fp32 master weights, dynamic loss scaling."""
from __future__ import annotations

import copy
from typing import Any, Iterable, Sequence

import torch

from psarch.meters import optimizer_state_bytes
from psarch.optim import build_optimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


class LossScaler:
    """Dynamic loss scaling for fp16 (as in Megatron/DeepSpeed): start at 2^16; on inf/nan gradients
    skip the step and, from the `hysteresis`-th such step since the start or the last growth on, halve
    the scale (never below `min_scale`); after `growth_interval` clean steps in a row, double it (and
    re-arm the hysteresis). Disabled (scale 1) for fp32 and bf16."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1.0) -> None:
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval, self.hysteresis, self.min_scale = growth_interval, hysteresis, min_scale
        self._good_steps = 0
        self._hysteresis_left = hysteresis

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def update(self, found_inf: bool) -> None:
        """Record one step's outcome and adjust the scale."""
        if not self.enabled:
            return
        if found_inf:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                # as Megatron's DynamicGradScaler: hysteresis is re-armed only by growth, so once spent,
                # every further overflow halves the scale
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale *= 2.0
                self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])


def has_inf_or_nan(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A 0-dim float tensor: 1.0 if any element of any tensor is inf or nan (stays on device, no sync).

    One foreach max-norm over all tensors (nan and inf propagate through it), not a check per tensor
    (torch._foreach_norm is private: the one fused multi-tensor norm torch has)."""
    # a sparse gradient (an embedding table's rows) is checked by its values
    tensors = [t.coalesce().values() if t.is_sparse else t for t in tensors]
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros(())
    norms = torch._foreach_norm(tensors, float("inf"))
    return (~torch.isfinite(torch.stack(norms))).any().float()


def step_if_finite(optimizer: torch.optim.Optimizer, grads: Iterable[torch.Tensor]) -> bool:
    """A plain torch optimizer's step unless a gradient holds inf/nan: the check MixedPrecisionOptimizer
    makes, for the torch peers that step torch's own optimizers. Returns True if the step was skipped."""
    if bool(has_inf_or_nan(grads).item()):
        return True
    optimizer.step()
    return False


class MasterWeights:
    """fp32 master weights of (possibly low-precision) model tensors; the optimizer steps on `params`.

    With low-precision model tensors the masters are one flat fp32 buffer (`masters` are views into it,
    shaped like the model tensors), so gradients go in with one cast and the update comes back with one
    copy. In fp32 the model tensors are their own masters: no copy is made and no memory is spent (give
    them as one flat tensor, as every backend does, for one fused optimizer kernel over one tensor).
    """

    def __init__(self, model_tensors: Sequence[torch.Tensor]) -> None:
        self.model_tensors = list(model_tensors)
        self.copies = any(t.dtype != torch.float32 for t in self.model_tensors)
        if self.copies:
            self.numel = sum(t.numel() for t in self.model_tensors)
            self.flat = torch.nn.Parameter(torch.cat([t.detach().reshape(-1).float() for t in self.model_tensors]))
            pieces = self.flat.detach().split([t.numel() for t in self.model_tensors])
            self.masters = [m.view(t.shape) for m, t in zip(pieces, self.model_tensors)]
            self.params: list[torch.Tensor] = [self.flat]
        else:
            self.masters = [t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=True)
                            for t in self.model_tensors]
            self.params = self.masters

    def set_grads(self, grads: Sequence[torch.Tensor], inv_scale: float = 1.0) -> None:
        """Give the optimizer its gradients in fp32, multiplied by `inv_scale` (1 / loss scale)."""
        if not self.copies:
            if inv_scale != 1.0:
                torch._foreach_mul_(list(grads), inv_scale)
            for m, g in zip(self.masters, grads):
                m.grad = g
            return
        # one fresh fp32 buffer: transient, freed after the step (so it is no model state)
        g32 = torch.empty(self.numel, dtype=torch.float32, device=self.flat.device)
        if len(grads) == 1:
            g32.copy_(grads[0].reshape(-1))
        else:
            torch.cat([g.reshape(-1) for g in grads], out=g32)
        if inv_scale != 1.0:
            g32.mul_(inv_scale)  # after the cast: scaling in fp16 could underflow
        self.flat.grad = g32

    def clear_grads(self) -> None:
        """Drop the transient fp32 gradient (low precision; in fp32 the gradients are the caller's)."""
        if self.copies:
            self.flat.grad = None

    def copy_to_model(self) -> None:
        """After the optimizer step: write the updated masters back into the model's dtype."""
        if self.copies:
            with torch.no_grad():
                if len(self.model_tensors) == 1:
                    self.model_tensors[0].copy_(self.masters[0])
                else:
                    torch._foreach_copy_(self.model_tensors, self.masters)

    def bytes(self) -> int:
        """Bytes of master copies beyond the model's own tensors (0 in fp32)."""
        return self.numel * 4 if self.copies else 0


class MixedPrecisionOptimizer:
    """An optimizer over fp32 masters of model tensors, with dynamic loss scaling for fp16.

    Backends hand it the (already synchronised) gradients of the tensors they own; it skips the step
    when any gradient is inf/nan (the caller passes `found_inf` when only a global check is valid). In
    every precision: fp16 skips such steps by design; in fp32/bf16 a skipped step is a refused one, which
    the runner turns into a NonFiniteGradient, so a model is never written with inf/nan."""

    def __init__(self, model_tensors: Sequence[torch.Tensor], train_cfg, precision: str, fused: bool = True) -> None:
        self.master = MasterWeights(model_tensors)
        self.optimizer = build_optimizer(self.master.params, train_cfg, fused)
        self.scaler = LossScaler(enabled=(precision == "fp16"))

    def step(self, grads: Sequence[torch.Tensor], found_inf: bool | None = None) -> bool:
        """Unscale, step, write back to the model tensors. Returns True if the step was skipped."""
        if found_inf is None:   # one fused check over all gradients, one host sync per step
            found_inf = bool(has_inf_or_nan(grads).item())
        if not found_inf:
            self.master.set_grads(grads, 1.0 / self.scaler.scale)
            self.optimizer.step()
            self.master.copy_to_model()
            self.master.clear_grads()
        self.scaler.update(found_inf)
        return found_inf

    def state_bytes(self) -> int:
        """Optimizer state plus fp32 master copies, in bytes."""
        return optimizer_state_bytes(self.optimizer) + self.master.bytes()

    def state_bytes_per_element(self) -> int:
        """Optimizer state (moments, momentum) plus fp32 master bytes held for each element stepped on."""
        state: dict[str, Any] = next(iter(self.optimizer.state.values()), {})
        per = sum(v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return per + (4 if self.master.copies else 0)

    def state_dict(self) -> dict:
        return {"optimizer": copy.deepcopy(self.optimizer.state_dict()), "scaler": self.scaler.state_dict(),
                "masters": [m.detach().clone() for m in self.master.masters] if self.master.copies else None}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if state.get("masters") is not None:
            with torch.no_grad():
                for m, s in zip(self.master.masters, state["masters"]):
                    m.copy_(s)
            self.master.copy_to_model()
