"""ZeRO stage 3: each rank keeps only its shard of the parameters; a unit is gathered when it is used.

Each unit (psarch.model_units: the model's blocks, plus the root holding everything else) is one group of the
partition: a flat buffer of the unit's parameters padded to N chunks. A rank holds its chunk of every
unit (`shard`, 1/N of the model) and the matching gradient chunk (`shard_grad`). The unit's full flat
buffer exists only while the unit is in use: its storage is resized to 0 when freed and back when
gathered (parameters are views into it, so modules and autograd's saved tensors see it re-appear).

Schedule of one step, as DeepSpeed's and FSDP's:
  forward:  gather root (model pre-hook); for each unit: gather (waiting for its prefetch), prefetch
            the next units up to `prefetch_bucket_size` elements, run, free.  Free root after forward.
  backward: when the gradient of the model's output arrives, gather root again and prefetch the last
            units; when the gradient of a unit's output arrives (a tensor hook: before any of the unit's
            backward runs), gather it, give its parameters gradient views into a transient unit-sized
            buffer, prefetch the units before it. When all of a unit's gradients have accumulated, free
            its parameters, pre-divide by N and reduce-scatter the buffer into `shard_grad` (with train.compression =
            "fp16"/"bf16" a 2-byte copy of it, zero/wire.py).
So every unit moves twice as an all-gather and once as a reduce-scatter: 3(N-1)/N of the padded bytes.
Frozen weights (train.trainable, LoRA's base) are sharded too (zero/frozen.py; every block holding a parameter is
then a unit): gathered with their unit, both times, and never reduced, 2(N-1)/N of their padded bytes; except
that a unit whose forward output requires no grad (it trains nothing, nor does anything before it: the leading
blocks of a model whose first layers are frozen) is never reached by backward, and is neither gathered nor
prefetched there: its frozen weights move once, (N-1)/N. A frozen unit after one that trains is reached (the
gradient flows through it to the earlier one) and is gathered both times. Their
backward computes no gradient of its own, only those flowing past them, so a unit that holds some is freed
once its gradients are reduced and the block before it has begun its backward (the unit's input gradient is
then complete), or at the end of backward; a unit of frozen weights only reduces nothing.
A unit whose parameters loss_fn reads outside the forward (zero.reads) is pinned: gathered on that read and
kept, with its gradient buffer, until backward has ended; its reduce-scatter, and those after it in
reduce order, then run after backward.
With overlap_comm = false the reduce-scatters block in the hook; prefetch_bucket_size = 0 turns
prefetching off (every gather then waits where the unit is needed): the plain schedule.
Units are gathered and prefetched in the order forward runs them (`order`: zero.theory.forward_order, as FSDP2 does),
not as registered; a unit forward never runs is neither gathered nor reduce-scattered (its gradient chunk is zero).
All collectives are issued in the same order on every rank (they follow the model's execution, which is
the same everywhere), and the ring runs them FIFO on its thread, overlapping the main thread's compute.
A model whose use of a unit depends on the data (one rank runs a unit in a step that another skips) breaks that
order, as it breaks FSDP's: not supported. A unit outside `order` that every rank runs is gathered where it runs.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from collective.comm import Communicator, Handle
from psarch.meters import Transient, WaitClock
from zero.export import gather_fp32
from zero.frozen import FrozenShards
from zero.partition import Partition
from zero.reads import ReadsOutsideForward
from zero.stage12 import MAX_IN_FLIGHT
from zero.wire import GradientWire, Land
from psarch.model_units import Unit

FREE, GATHERING, GATHERED = "free", "gathering", "gathered"


class Stage3:
    """Sharded parameters, gathered unit by unit around forward and backward, on one rank."""

    def __init__(self, model: nn.Module, units: list[Unit], comm: Communicator, prefetch_numel: int,
                 overlap_comm: bool, compression: str = "none", order: list[int] | None = None) -> None:
        self.comm, self.rank, self.n = comm, comm.rank, comm.world_size
        self.units, self.prefetch_numel, self.overlap = units, prefetch_numel, overlap_comm
        self.part = Partition([u.params for u in units], self.n)
        self.trains = [g.numel > 0 for g in self.part.groups]   # a unit of frozen weights only reduces nothing
        first = next(p for u in units for p in u.params)
        dtype, device = first.dtype, first.device
        self.shard = torch.zeros(self.part.shard_numel, dtype=dtype, device=device)
        self.shard_grad = torch.zeros_like(self.shard)
        self.full: list[torch.Tensor] = []
        with torch.no_grad():
            for g in self.part.groups:
                full = torch.zeros(g.padded, dtype=dtype, device=device)
                for p, view in zip(g.params, self.part.group_views(g, full)):
                    view.copy_(p.data)
                    p.data = view
                comm.broadcast(full, src=0)  # every rank starts from rank 0's parameters
                self.part.shard_chunk(g, self.shard).copy_(self.part.group_chunk(g, full, self.rank))
                full.untyped_storage().resize_(0)
                self.full.append(full)
        self.frozen = FrozenShards(units, comm)
        self.state = [FREE] * len(units)
        self._gathers: dict[int, list[Handle]] = {}
        self._grads: dict[int, torch.Tensor] = {}
        self._pending: list[tuple[Handle | None, int, Land]] = []   # (handle, unit, what lands its reduced chunk)
        self._group_of = {id(p): g for g in self.part.groups for p in g.params}
        self._index_in_group = {id(p): i for g in self.part.groups for i, p in enumerate(g.params)}
        self.forward_order = list(range(1, len(units))) if order is None else [i for i in order if i]   # blocks run
        self.idle = set(range(1, len(units))) - set(self.forward_order)   # units forward never runs
        self.backward_order = [0] + self.forward_order[::-1]      # the order units start backward
        self.reduce_order = self.forward_order[::-1] + [0] + sorted(self.idle)   # the order their gradients complete
        self._next = 0
        self._bwd_started: set[int] = set()
        self._reached: set[int] = set()      # units whose output requires grad in this forward: backward reaches them
        self._reduced: set[int] = set()      # units whose gradients are reduced (or that have none)
        self._inputs_done: set[int] = set()  # blocks whose backward is over: the block before them began its own
        self.pinned: set[int] = set()   # units read outside forward: gathered until their gradients are reduced
        self._unit_of = {id(p): i for i, u in enumerate(units) for p in [*u.params, *u.frozen]}
        self.phase = "idle"
        self.transient = Transient()   # gathered units ('gathered') and unit gradient buffers ('grads')
        self.wire = GradientWire(self.n, compression, self.transient)   # gradients whole, or cast to 2 bytes
        self.prefetched = 0            # gathers started ahead of their unit's use
        self.reduced_in_backward = 0   # asynchronous reduce-scatters launched from gradient hooks: the overlap
        self.waits = WaitClock()       # time blocked on gathers and reductions, inside forward and backward too
        self._hooks = [model.register_forward_pre_hook(self._model_pre), model.register_forward_hook(self._model_post)]
        for i, u in enumerate(units):
            if u.module is not None:
                self._hooks += [u.module.register_forward_pre_hook(self._unit_pre(i)),
                                u.module.register_forward_hook(self._unit_post(i))]
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for g in self.part.groups for p in g.params]

    # ---- gather and free one unit

    def _gather(self, i: int, async_op: bool) -> None:
        """All-gather unit i: the parameters that train (where it has any), then its frozen weights (where it has
        any), two collectives issued together."""
        g, full = self.part.groups[i], self.full[i]
        handles = []
        if self.trains[i]:
            self._resize(full, g.padded * full.element_size())
            handle = self.comm.all_gather(full, self.part.shard_chunk(g, self.shard), async_op=True)
            assert handle is not None   # async_op=True returns a Handle
            handles.append(handle)
        if self.frozen.numel(i):
            self._resize(self.frozen.full[i], self.frozen.numel(i) * self.frozen.full[i].element_size())
            handles.append(self.frozen.gather(i))
        self.state[i] = GATHERING
        self._gathers[i] = handles
        if not async_op:
            self._wait(i)

    def _wait(self, i: int) -> None:
        if self.state[i] == GATHERING:
            with self.waits:
                for handle in self._gathers.pop(i):
                    handle.wait()
            self.state[i] = GATHERED

    def ensure(self, i: int) -> None:
        """Unit i's full parameters, here and complete."""
        if self.state[i] == FREE:
            self._gather(i, async_op=False)
        self._wait(i)

    def free(self, i: int) -> None:
        if self.state[i] == FREE or i in self.pinned:
            return
        self._wait(i)
        self._resize(self.full[i], 0)
        if self.frozen.numel(i):
            self._resize(self.frozen.full[i], 0)
        self.state[i] = FREE

    def _resize(self, full: torch.Tensor, nbytes: int) -> None:
        """Resize a unit's full buffer, booking the change of its storage as measured before and after,
        so a unit left allocated stays in the gathered count."""
        st = full.untyped_storage()
        before = st.nbytes()
        st.resize_(nbytes)
        self.transient.add("gathered", st.nbytes() - before)

    def _prefetch(self, order: list[int]) -> None:
        """Start gathering the next units of `order`, up to prefetch_bucket_size elements (at least one)."""
        budget = self.prefetch_numel
        for i in order:
            if budget <= 0:
                return
            if self.state[i] == FREE:
                self._gather(i, async_op=True)
                self.prefetched += 1
            budget -= self.part.groups[i].padded + self.frozen.numel(i)

    def pin_param(self, t: torch.Tensor) -> None:
        """`t` is read outside the model's forward: if it is a parameter, pin its unit."""
        i = self._unit_of.get(id(t))
        if i is not None and i not in self.pinned:
            self.ensure(i)
            self.pinned.add(i)
            self._grad_views(i)

    def reads_outside_forward(self) -> ReadsOutsideForward:
        """The context loss_fn runs in: parameters it reads outside the model's forward are gathered."""
        return ReadsOutsideForward(self)

    # ---- forward hooks

    def _model_pre(self, module: nn.Module, args: Any) -> None:
        if self.phase != "idle":
            return
        self.phase = "forward"
        self.ensure(0)
        self._prefetch(self.forward_order)

    def _unit_pre(self, i: int):
        def hook(module: nn.Module, args: Any) -> None:
            if self.phase == "forward":
                self.ensure(i)
                self._prefetch(_after(self.forward_order, i))
        return hook

    def _unit_post(self, i: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.phase == "forward":
                self.free(i)
                self._on_output_grad(output, i)
        return hook

    def _model_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.phase == "forward":
            self.free(0)
            self._on_output_grad(output, 0)
            self.phase = "between"

    def _on_output_grad(self, output: Any, i: int) -> None:
        """Gather unit i for backward when its output's gradient arrives. An output that requires no grad (the unit
        trains nothing, nor does anything before it) is never reached by backward: the unit is not gathered again."""
        for t in tree_flatten(output)[0]:
            if torch.is_tensor(t) and t.requires_grad:
                self._reached.add(i)
                t.register_hook(lambda grad, i=i: self._pre_backward(i))

    # ---- backward

    def _pre_backward(self, i: int) -> None:
        if i in self._bwd_started:
            return
        for k in self._bwd_started - {0} - self._inputs_done:   # the blocks after i: their backward is over
            self._inputs_done.add(k)
            if k in self._reduced:
                self.free(k)
        self._bwd_started.add(i)
        self.phase = "backward"
        self.ensure(i)
        self._grad_views(i)
        self._prefetch([k for k in _after(self.backward_order, i) if k in self._reached])

    def _grad_views(self, i: int) -> None:
        """Unit i's gradient buffer (made once a step), its parameters' gradients views into it."""
        if i in self._grads or not self.trains[i]:
            return
        g = self.part.groups[i]
        buf = self._grads[i] = torch.zeros(g.padded, dtype=self.shard.dtype, device=self.shard.device)
        self.transient.add("grads", buf.numel() * buf.element_size())
        for p, view in zip(g.params, self.part.group_views(g, buf)):
            p.grad = view  # autograd accumulates in place into the unit's gradient buffer

    def _on_grad(self, p: torch.Tensor) -> None:
        g = self._group_of[id(p)]
        if g.index in self.pinned:   # gradients from the loss term and the model: reduced after backward
            return
        i = self._index_in_group[id(p)]
        if i in g.ready:
            raise RuntimeError("ZeRO-3: a parameter received its gradient twice in one backward "
                               "(reused parameters are not supported)")
        g.ready.add(i)
        while self._next < len(self.reduce_order) and self.part.groups[self.reduce_order[self._next]].full:
            if self._reduce(self.reduce_order[self._next]) and self.overlap:
                self.reduced_in_backward += 1   # a blocking reduce-scatter in the hook overlaps nothing

    def _reduce(self, i: int) -> bool:
        """Reduce-scatter unit i's gradients (whether one was launched: a unit of frozen weights only has none)."""
        self._next += 1
        g = self.part.groups[i]
        buf = self._grads.get(i)
        if not self.trains[i] or buf is None and i in self.idle:   # frozen only, or never run (on any rank): no gradient
            self.part.shard_chunk(g, self.shard_grad).zero_()
            self._release(i)
            return False
        if buf is None:  # no gradient reached this unit: reduce zeros, as every rank does
            buf = self._grads[i] = torch.zeros(g.padded, dtype=self.shard.dtype, device=self.shard.device)
            self.transient.add("grads", buf.numel() * buf.element_size())
        for p in g.params:
            p.grad = None
        self.pinned.discard(i)
        self._release(i)
        sent, received, land = self.wire.send(buf, self.part.shard_chunk(g, self.shard_grad))
        with self.waits:   # without overlap_comm the reduce-scatter blocks here, in backward's hook
            handle = self.comm.reduce_scatter(received, sent, async_op=self.overlap)
        self._pending.append((handle, i, land))
        self._reap(keep=MAX_IN_FLIGHT)
        return True

    def _release(self, i: int) -> None:
        """Unit i's gradients are reduced: free it, unless its frozen weights may still be read by its backward.
        A frozen weight's backward computes no gradient of its own, only those flowing past it: to the unit's
        parameters (all accumulated by now) or to the unit's input, which is over once the block before it begins
        its backward (the root, reduced last, after every block: at once)."""
        self._reduced.add(i)
        if not self.frozen.numel(i) or i == 0 or i in self._inputs_done:
            self.free(i)

    def _reap(self, keep: int) -> None:
        while self._pending:
            handle, i, land = self._pending[0]
            if handle is not None:
                if len(self._pending) <= keep and not handle.is_completed():
                    return
                with self.waits:
                    handle.wait()
            self._pending.pop(0)
            land()
            buf = self._grads.pop(i)
            self.transient.sub("grads", buf.numel() * buf.element_size())

    def begin_step(self) -> None:
        for g in self.part.groups:
            g.ready.clear()
        self._next = 0
        for done in (self._bwd_started, self._reached, self._reduced, self._inputs_done):
            done.clear()
        self.phase = "idle"

    def reduce_gradients(self) -> None:
        """After backward: reduce the units left, wait for every reduce-scatter, free every unit."""
        while self._next < len(self.reduce_order):
            self._reduce(self.reduce_order[self._next])
        self._reap(keep=0)
        self.pinned.clear()   # a unit of frozen weights only, read outside forward, is kept until here
        for i in range(len(self.units)):
            self.free(i)
        self.phase = "idle"

    # ---- the optimizer's view, and export

    def param_shards(self) -> list[torch.Tensor]:
        return [self.shard]

    def grad_shards(self) -> list[torch.Tensor]:
        return [self.shard_grad]

    def full_params(self, masters: list[torch.Tensor], keep: bool) -> dict[int, torch.Tensor]:
        """fp32 CPU copies of the parameters (id -> tensor) on ranks with `keep`, gathered one unit at a
        time. Collective."""
        (master,) = masters
        trained = gather_fp32(self.comm, self.part, [self.part.shard_chunk(g, master) for g in self.part.groups], keep)
        return {**trained, **self.frozen.full_params(keep)}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def _after(order: list[int], i: int) -> list[int]:
    """The units after unit i in `order` (none where i is not in it: a unit run though forward's order had not)."""
    return order[order.index(i) + 1:] if i in order else []
