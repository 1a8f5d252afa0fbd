"""A worker's FLOPs per step, counted once by torch's own FlopCounterMode: forward and backward apart, and
where they fall, so a virtual device can spend its modelled time where the real device would.

The count runs one forward and one backward of a copy of the model on the meta device (shapes, no data, no
state of the real model touched); a loss function that needs real values (`.item()` inside it) is counted
on a real copy instead, with the random state put back afterwards.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class FlopCount:
    """One worker's FLOPs for one step (its shard of the global batch), and where they fall: the fraction
    of the forward's FLOPs done when each module is first entered (`module_marks`, by position in
    model.modules()) and of the backward's done when each parameter's gradient is ready (`param_marks`,
    by position in model.parameters()); None where a module is never entered or a parameter gets no gradient."""

    forward: int
    backward: int
    module_marks: tuple[float | None, ...]
    param_marks: tuple[float | None, ...]


def count(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> FlopCount:
    """The FLOPs of loss_fn(model, batch) and its backward, as FlopCounterMode counts them."""
    try:
        return _count(copy.deepcopy(model).to("meta"), loss_fn, tree_map(_to_meta, batch))
    except (NotImplementedError, RuntimeError):   # a loss that reads values: count on a real copy
        with torch.random.fork_rng(devices=[]):
            return _count(copy.deepcopy(model), loss_fn, batch)


def _to_meta(x: Any) -> Any:
    return x.to("meta") if torch.is_tensor(x) else x


def _fraction(done: int, total: int) -> float:
    return done / total if total else 0.0


def _count(model: nn.Module, loss_fn: Callable, batch: Any) -> FlopCount:
    modules, params = list(model.modules()), list(model.parameters())
    entered: list[int | None] = [None] * len(modules)
    ready: list[int | None] = [None] * len(params)
    counter = FlopCounterMode(display=False)

    def on_enter(i: int) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            if entered[i] is None:
                entered[i] = counter.get_total_flops()
        return hook

    def on_ready(i: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            ready[i] = counter.get_total_flops()
        return hook

    handles = [m.register_forward_pre_hook(on_enter(i)) for i, m in enumerate(modules)]
    handles += [p.register_hook(on_ready(i)) for i, p in enumerate(params) if p.requires_grad]
    try:
        with counter:
            loss = loss_fn(model, batch)
        forward = counter.get_total_flops()
        counter = FlopCounterMode(display=False)   # the backward's own count, from 0
        with counter:
            loss.backward()
        backward = counter.get_total_flops()
    finally:
        for h in handles:
            h.remove()
    return FlopCount(forward, backward, tuple(None if e is None else _fraction(e, forward) for e in entered),
                     tuple(None if r is None else _fraction(r, backward) for r in ready))
