"""ZeRO-3 parameters read outside the model's forward (an L2 term in loss_fn, a norm computed there).

Outside forward a unit's parameters are views into a freed buffer: reading one would read unallocated
memory. While loss_fn runs, ReadsOutsideForward (a TorchFunctionMode) sees every torch call; one that takes
a parameter of a unit outside the model's forward pins the unit (Stage3.pin): gathered at once and kept
until its gradients are reduced after backward, with its gradient buffer in place, so both the term's and
the model's gradients accumulate into it. It is what FSDP's summon_full_params does by hand, here on the
first read. Every rank runs the same loss_fn, so every rank pins the same units in the same order.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten



class Pinning(Protocol):
    """What the mode needs of the engine (zero.stage3.Stage3): its phase, and pinning a parameter's unit."""

    phase: str

    def pin_param(self, t: torch.Tensor) -> None: ...

# what reads no element: a freed parameter answers these, and they gather nothing
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride,
             torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,  # type: ignore[attr-defined]
             torch.Tensor.requires_grad.__get__, torch.Tensor.is_floating_point}  # type: ignore[attr-defined]


class ReadsOutsideForward(TorchFunctionMode):
    """Pins the unit of every parameter a torch call takes while the engine is outside the model's forward."""

    def __init__(self, engine: Pinning) -> None:
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.engine.phase != "forward" and func not in _METADATA:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    self.engine.pin_param(t)
        return func(*args, **kwargs)
