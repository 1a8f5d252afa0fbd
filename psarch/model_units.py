"""Units: the pieces of a model ZeRO-3 gathers one at a time, ZeRO-R checkpoints one at a time and a pipeline
cuts into stages (zero/ and collective/pipeline/ share them, so they live in the core).

By default each child of `model.blocks` (an nn.ModuleList: the built-in GPT's and MLP's blocks) is a
unit; every parameter outside them (embeddings, final norm, head) forms the *root* unit, which is
gathered around the whole forward and the whole backward. `backend.zero_units` names another attribute,
or '' for the whole model as one unit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint


@dataclass
class Unit:
    """A module (None for the root) and the parameters it alone owns, in registration order: those that train
    (`params`) and those frozen (`frozen`: train.trainable, LoRA's base weights)."""

    name: str
    module: nn.Module | None
    params: list[nn.Parameter]
    frozen: list[nn.Parameter] = field(default_factory=list)


def find_units(model: nn.Module, attr: str = "blocks", frozen_too: bool = False) -> list[Unit]:
    """[root, unit 0, unit 1, ...]: the children of `model.<attr>` that hold a parameter that trains (with
    frozen_too, every one that holds a parameter: a pipeline cuts the model along all its blocks, and ZeRO-3
    shards them, frozen ones too; a parameterless module between them still runs on no stage), and the root
    holding the rest (the frozen parameters of a block that is no unit included).

    A parameter shared between units (tied weights) would be gathered by one and used by another, so it
    is refused with a message that says what to do."""
    blocks: list[nn.Module] = []
    if attr:
        holder = getattr(model, attr, None)
        if holder is None and attr != "blocks":  # the default may be absent: the model is then one unit
            raise ValueError(f"backend.zero_units = {attr!r}: the model ({type(model).__name__}) has no attribute "
                             f"{attr!r}; name its nn.ModuleList of units, or set zero_units = ''")
        if holder is None:
            blocks = []
        elif isinstance(holder, (nn.ModuleList, nn.Sequential)):
            blocks = list(holder)
        else:
            raise ValueError(f"backend.zero_units = {attr!r}: model.{attr} is a {type(holder).__name__}, "
                             f"expected an nn.ModuleList of units (or set zero_units = '')")
    owner: dict[int, str] = {}
    units: list[Unit] = []
    for i, block in enumerate(blocks):
        params = [p for p in block.parameters() if p.requires_grad]
        frozen = [p for p in block.parameters() if not p.requires_grad]
        if not (params or frozen_too and frozen):
            continue
        for p in params + (frozen if frozen_too else []):   # a frozen weight moves only where units hold them
            if id(p) in owner:
                raise ValueError(f"backend.zero_units: a parameter is shared by {owner[id(p)]} and {attr}.{i}; "
                                 f"shared parameters must live in one unit (choose coarser units)")
            owner[id(p)] = f"{attr}.{i}"
        owner.update((id(p), f"{attr}.{i}") for p in frozen if id(p) not in owner)
        units.append(Unit(f"{attr}.{i}", block, params, frozen))
    rest = [p for p in model.parameters() if id(p) not in owner]
    root = Unit("root", None, [p for p in rest if p.requires_grad], [p for p in rest if not p.requires_grad])
    return [root] + units


@dataclass
class ForwardReach:
    """What one forward does with the units of find_units (root first): `order`, the units in the order their
    forward ends (the root last; a unit that never runs is left out), and `reached`, whether backward reaches each."""

    order: list[int]
    reached: list[bool]


def forward_reach(model: nn.Module, units: list[Unit], run: Callable[[], Any]) -> ForwardReach:
    """Runs `run` (a loss through `model`: on the meta device, shapes alone) once with forward hooks on the model
    and each unit, and reads which units backward reaches as zero/stage3.py decides it: those whose output requires
    grad (a parameter that trains is used in them or upstream of them); the root's output is the model's. Reach
    follows what the forward does, not the order the units are registered in (DLRM's tables, registered first, run
    after its bottom MLP)."""
    order: list[int] = []
    reached = [False] * len(units)

    def hook(i: int) -> Callable[..., None]:
        def after(module: nn.Module, args: Any, output: Any) -> None:
            if i not in order:
                order.append(i)
            reached[i] = reached[i] or any(torch.is_tensor(t) and t.requires_grad for t in tree_flatten(output)[0])
        return after

    handles = [model.register_forward_hook(hook(0))]
    handles += [u.module.register_forward_hook(hook(i)) for i, u in enumerate(units) if i and u.module is not None]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return ForwardReach([i for i in order if i] + [i for i in order if not i], reached)


def checkpoint_units(units: list[Unit]) -> None:
    """Wrap each unit's forward in activation checkpointing (non-reentrant): only the unit's inputs
    are kept for backward, and its activations are recomputed there."""
    for u in units:
        if u.module is None:
            continue
        forward = u.module.forward

        def checkpointed(*args: Any, _forward=forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        u.module.forward = checkpointed  # instance attribute: module hooks still run around it
