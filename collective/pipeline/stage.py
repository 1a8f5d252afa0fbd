"""Cutting a model into pipeline stages along its units (psarch/model_units.py: the children of `model.blocks`),
without rewriting its forward.

The blocks are split into P contiguous runs, one per virtual stage. The modules outside the blocks that own
parameters (the root) go with the first stage when the forward calls them before the first block (GPT's
token and position embeddings), with the last when it calls them after the last block (final norm, head);
one trace of the forward on a micro-batch tells which, and the shapes the stages exchange.

A stage then runs the workload's own `loss_fn(model, micro_batch)` with the model's modules switched per
call (`Cut.running`): blocks outside the stage pass their input through, the first block of the stage takes
the activation received instead of its input, the stage's last block ends the forward by raising
StageOutput with its output (but on the last stage, whose forward runs on to the loss), and root modules
of the first stage return zeros of their traced shape on every other stage (their parameters are not there).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from psarch.model_units import find_units


class StageOutput(Exception):
    """Raised by a stage's last block to end the forward there, carrying the activation to send on."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.output = output


def split_blocks(n_blocks: int, stages: int) -> list[range]:
    """Blocks of each of `stages` virtual stages: contiguous, as even as can be (the first ones one more)."""
    if n_blocks < stages and stages > 1:
        raise ValueError(f"the model has {n_blocks} blocks (its backend.zero_units), fewer than the {stages} "
                         f"virtual stages (backend.stages x backend.virtual_stages) that each need one")
    base, extra = divmod(n_blocks, stages)
    bounds = [0]
    for j in range(stages):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return [range(bounds[j], bounds[j + 1]) for j in range(stages)]


@dataclass
class Trace:
    """What one forward told: the root modules called before the first block (`pre`, with their output
    shapes and dtypes) and after the last (`post`), and the input shape and dtype of every block."""

    pre: dict[str, tuple[torch.Size, torch.dtype]]
    post: list[str]
    block_inputs: list[tuple[torch.Size, torch.dtype]]


def root_modules(model: nn.Module, blocks: list[nn.Module]) -> dict[str, nn.Module]:
    """Modules outside the blocks that hold parameters of their own (embeddings, norms, head; frozen ones too, so
    that only their stage keeps them); a trainable parameter of the root held by no such module cannot be placed,
    and is refused (a frozen one stays on every stage)."""
    inside = {id(p) for b in blocks for p in b.parameters()}
    out = {name: mod for name, mod in model.named_modules()
           if any(id(p) not in inside for p in mod.parameters(recurse=False))
           and (name or any(p.requires_grad for p in mod.parameters(recurse=False)))}
    placed = {id(p) for mod in out.values() for p in mod.parameters(recurse=False)}
    stray = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside | placed]
    if stray or "" in out:
        raise ValueError(f"pipeline: parameter {(stray or [n for n, _ in model.named_parameters(recurse=False)])[0]!r} "
                         f"is the model's own, not a submodule's: a pipeline places modules on stages; move it into "
                         f"a submodule")
    return out


def trace(model: nn.Module, blocks: list[nn.Module], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
          micro_batch: Any) -> Trace:
    """Run loss_fn once (no gradients; random generators restored after) with hooks that record the order of
    calls; any device works, the meta device too."""
    roots = root_modules(model, blocks)
    calls: list[tuple[str, Any]] = []
    inputs: dict[int, tuple[torch.Size, torch.dtype]] = {}
    hooks = []
    for i, b in enumerate(blocks):
        def pre_hook(mod: nn.Module, args: tuple, i: int = i) -> None:
            if len(args) != 1 or not torch.is_tensor(args[0]):
                raise ValueError(f"pipeline: block {i} takes {len(args)} positional arguments; a stage boundary "
                                 f"carries one activation tensor")
            inputs.setdefault(i, (args[0].shape, args[0].dtype))
            calls.append(("block", i))
        hooks.append(b.register_forward_pre_hook(pre_hook))
    inside = {id(m) for b in blocks for m in b.modules()}
    ids = {id(b) for b in blocks}
    names = [n for n, m in model.named_modules() if id(m) in ids]
    # the containers of the blocks (the model, its ModuleList) are called around them
    around = {id(model.get_submodule(".".join(n.split(".")[:i]))) for n in names for i in range(n.count(".") + 1)}
    for name, mod in model.named_modules():
        if id(mod) in inside or id(mod) in around:
            continue   # a block's own modules, or a container of blocks (called around them)
        def hook(mod: nn.Module, args: tuple, out: Any, name: str = name) -> None:
            calls.append((name, (out.shape, out.dtype) if torch.is_tensor(out) else None))
        hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            loss_fn(model, micro_batch)
    finally:
        for h in hooks:
            h.remove()
    return _classify(calls, inputs, len(blocks), set(roots))


def _classify(calls: list[tuple[str, Any]], inputs: dict, n_blocks: int, roots: set[str]) -> Trace:
    """Root modules (with parameters) before the blocks and after them; any module between blocks is refused:
    it would run on no stage (a pipeline cuts between blocks)."""
    seen = [i for kind, i in calls if kind == "block"]
    if seen != list(range(n_blocks)):
        raise ValueError(f"pipeline: the forward calls the blocks in the order {seen}; a pipeline needs each "
                         f"block once, in order 0..{n_blocks - 1}")
    first = next(k for k, (kind, _) in enumerate(calls) if kind == "block")
    last = max(k for k, (kind, _) in enumerate(calls) if kind == "block")
    pre: dict[str, tuple[torch.Size, torch.dtype]] = {}
    post: list[str] = []
    for k, (name, out) in enumerate(calls):
        if name == "block":
            continue
        if first < k < last:
            raise ValueError(f"pipeline: module {name!r} is called between blocks, so it would run on no stage; "
                             f"choose units (backend.zero_units) that include it")
        if name not in roots:
            continue   # no parameters: it runs wherever its caller runs
        if k < first:
            if out is None:
                raise ValueError(f"pipeline: module {name!r} (before the blocks) returns no single tensor")
            pre[name] = out
        elif name not in post:
            post.append(name)
    both = sorted(set(pre) & set(post))
    if both:
        raise ValueError(f"pipeline: module {both[0]!r} is called before and after the blocks (a tied weight?); "
                         f"the first and last stages cannot share it")
    return Trace(pre, post, [inputs[i] for i in range(n_blocks)])


@dataclass
class Running:
    """What the model's switched modules do in the current call: blocks [first, last] run, `input` replaces
    block first's input (None: the data's own), `final`: the last virtual stage, whose forward goes on."""

    first: int
    last: int
    input: torch.Tensor | None
    final: bool


class Cut:
    """A model cut into virtual stages, held by one rank: the parameters of its chunks, the others dropped."""

    def __init__(self, model: nn.Module, units_attr: str, loss_fn: Callable, micro_batch: Any, stages: int,
                 chunks: list[int]) -> None:
        self.model = model
        units = find_units(model, units_attr, frozen_too=True)
        self.blocks = [u.module for u in units[1:] if u.module is not None]   # only the root's is None
        # one stage (gradient accumulation over micro-batches) needs no cut, nor blocks at all
        self.trace = trace(model, self.blocks, loss_fn, micro_batch) if stages > 1 else Trace({}, [], [])
        self.ranges = split_blocks(len(self.blocks), stages)
        self.stages, self.chunks = stages, chunks       # the virtual stages this rank holds, by chunk
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.numels = {id(p): p.numel() for p in model.parameters()}   # before the other stages' are dropped
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
        self.roots = root_modules(model, self.blocks)
        self.owners = self._owners()
        # frozen parameters a stage keeps (a frozen one of the root's own stays on every stage, no stage's to export)
        self.frozen_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()
                              if not p.requires_grad and id(p) in self.owners}
        self.params = [p for p in model.parameters() if p.requires_grad and self.owners[id(p)] in chunks]
        self._running: Running | None = None
        self._drop_others()
        if stages > 1:
            self._switch()

    def _owners(self) -> dict[int, int]:
        """The virtual stage of every parameter (but a frozen one of the root's own, kept on every stage)."""
        owner = {}
        for j, blocks in enumerate(self.ranges):
            for i in blocks:
                owner.update({id(p): j for p in self.blocks[i].parameters()})
        for name, mod in self.roots.items():
            j = 0 if name in self.trace.pre or self.stages == 1 else self.stages - 1
            owner.update({id(p): j for p in mod.parameters(recurse=False)})
        return owner

    def stage_params(self, trainable: bool = True) -> list[int]:
        """Trainable parameters (elements) of each virtual stage; with trainable False, its frozen ones (a frozen
        parameter of the root's own, on no stage's module, counts on every stage)."""
        counts = [0] * self.stages
        for p in self.model.parameters():
            if p.requires_grad != trainable:
                continue
            for j in [self.owners[id(p)]] if id(p) in self.owners else range(self.stages):
                counts[j] += self.numels[id(p)]
        return counts

    def _drop_others(self) -> None:
        """Free what other stages hold: their parameters, frozen ones too, become empty (their modules never
        compute here)."""
        with torch.no_grad():
            for p in self.model.parameters():
                if id(p) in self.owners and self.owners[id(p)] not in self.chunks:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _switch(self) -> None:
        for i, block in enumerate(self.blocks):
            block.forward = self._block_forward(i, block.forward)
        for name in self.trace.pre:
            mod = self.model.get_submodule(name)
            mod.forward = self._pre_forward(name, mod.forward)

    def _block_forward(self, i: int, forward: Callable) -> Callable:
        def switched(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            run = self._running
            if run is None:
                return forward(x, *args, **kwargs)
            if not run.first <= i <= run.last:
                return x
            out = forward(run.input if i == run.first and run.input is not None else x, *args, **kwargs)
            if i == run.last and not run.final:
                raise StageOutput(out)
            return out
        return switched

    def _pre_forward(self, name: str, forward: Callable) -> Callable:
        shape, dtype = self.trace.pre[name]

        def switched(*args: Any, **kwargs: Any) -> torch.Tensor:
            run = self._running
            if run is None or run.first == 0:
                return forward(*args, **kwargs)
            return torch.zeros((), dtype=dtype, device=self.device).expand(shape)
        return switched

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @contextlib.contextmanager
    def running(self, stage: int, input: torch.Tensor | None) -> Iterator[None]:
        """Within: the model computes virtual stage `stage` (one of this rank's), from `input`."""
        blocks = self.ranges[stage]
        self._running = Running(blocks.start, blocks.stop - 1, input, stage == self.stages - 1)
        try:
            yield
        finally:
            self._running = None

    def input_shape(self, stage: int) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of the activation virtual stage `stage` (> 0) receives."""
        return self.trace.block_inputs[self.ranges[stage].start]
