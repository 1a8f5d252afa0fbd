"""What ZeRO stages 1 and 2 share: full flat parameters, gradients reduce-scattered bucket by bucket.

Parameters live in one flat buffer, in reverse registration order (gradients become ready roughly in
that order), cut into buckets of at most `reduce_bucket_size` elements, and also where one unit's
parameters end and another's begin (psarch.model_units), so that checkpoint export, which moves the model bucket
by bucket, never holds more than one unit's full parameters at once; each bucket is padded to a multiple of N
and rank r owns chunk r of every bucket (zero.partition). After backward each rank holds the averaged
gradient of its chunks only, its optimizer updates them, and the updated chunks are all-gathered back
into every rank's full buffer: reduce-scatter + all-gather = 2(N-1)/N of the (padded) bytes, per step; with
train.compression = "fp16"/"bf16" the reduce-scatter moves a 2-byte copy of the gradients (zero/wire.py).
The all-gathers go bucket by bucket, as many in flight as fit in `allgather_bucket_size` elements.

Where a bucket's gradient is kept and where its reduced chunk lands is what tells the stages apart:
zero.stage1.Stage1 (a full gradient buffer) and zero.stage2.Stage2 (a shard-sized one) fill in the
three steps this class leaves open (`_take_grad`, `_reduce_pair`, `_reduced`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from collective.comm import Communicator
from psarch.meters import Transient, WaitClock
from zero.export import gather_fp32
from zero.partition import Group, Partition, bucket_params
from zero.wire import GradientWire, Land

# Reduce-scatters left in flight when a new one is launched; beyond that the oldest is waited for. Bounds
# the transient gradient buffers, as DeepSpeed bounds its reduction buckets by double-buffering them.
MAX_IN_FLIGHT = 2


class Stage12(ABC):
    """Flat full parameters and the bucketed reduce-scatter / all-gather schedule of ZeRO stages 1-2 on
    one rank; a subclass says where gradients are kept (stage 1 or 2)."""

    reduce_in_hook: bool  # whether a full bucket is reduced from the gradient hook (else after backward)

    def __init__(self, params: list[torch.nn.Parameter], comm: Communicator, reduce_bucket_size: int,
                 overlap_comm: bool, allgather_bucket_size: int = 5 * 10**8,
                 unit_of: dict[int, int] | None = None, compression: str = "none") -> None:
        self.comm, self.overlap = comm, overlap_comm
        self.allgather_numel = allgather_bucket_size
        self.rank, self.n = comm.rank, comm.world_size
        params = params[::-1]
        self.part = Partition(bucket_params(params, reduce_bucket_size, unit_of), self.n)
        self.flat = torch.zeros(self.part.padded_numel, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for g in self.part.groups:
                for p, view in zip(g.params, self.part.group_views(g, self.part.flat_region(g, self.flat))):
                    view.copy_(p.data)
                    p.data = view
        comm.broadcast(self.flat, src=0)  # every rank starts from rank 0's parameters
        self._group_of = {id(p): g for g in self.part.groups for p in g.params}
        self._index_in_group = {id(p): i for g in self.part.groups for i, p in enumerate(g.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        # (handle, group, input, output, land: the output in its place once the handle is done)
        self._pending: list[tuple[Any, Group, torch.Tensor, torch.Tensor, Land]] = []
        self._next = 0
        self.transient = Transient()
        self.wire = GradientWire(self.n, compression, self.transient)   # whole, or cast to 2 bytes
        self.reduced_in_backward = 0   # asynchronous reduce-scatters launched from gradient hooks: the overlap
        self.waits = WaitClock()       # time blocked on collectives, hooks included (a straggler leaves it out)

    # ---- what a stage decides

    @abstractmethod
    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunks, one per bucket (what the optimizer steps with)."""

    @abstractmethod
    def _take_grad(self, g: Group, i: int, p: torch.Tensor) -> None:
        """Parameter i of bucket g has its gradient in p.grad: keep it where the bucket is reduced from."""

    @abstractmethod
    def _reduce_pair(self, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of bucket g's reduce-scatter: its `padded` gradient elements, this rank's chunk."""

    @abstractmethod
    def _reduced(self, g: Group, input: torch.Tensor, output: torch.Tensor) -> None:
        """Bucket g's reduce-scatter has finished."""

    # ---- what the optimizer sees: this rank's chunks

    def param_shards(self) -> list[torch.Tensor]:
        return [self.part.flat_chunk(g, self.flat, self.rank) for g in self.part.groups]

    # ---- backward: gradients into buckets, full buckets reduce-scattered in bucket order

    def begin_step(self) -> None:
        for g in self.part.groups:
            g.ready.clear()
        self._next = 0

    def _alloc(self, numel: int, like: torch.Tensor, kind: str = "grads") -> torch.Tensor:
        t = torch.empty(numel, dtype=like.dtype, device=like.device)  # callers fill or zero what they use
        self.transient.add(kind, t.numel() * t.element_size())
        return t

    def _release(self, t: torch.Tensor, kind: str = "grads") -> None:
        self.transient.sub(kind, t.numel() * t.element_size())

    def _on_grad(self, p: torch.Tensor) -> None:
        g = self._group_of[id(p)]
        i = self._index_in_group[id(p)]
        if i in g.ready:
            raise RuntimeError("ZeRO: a parameter received its gradient twice in one backward "
                               "(reused parameters are not supported)")
        self._take_grad(g, i, p)
        g.ready.add(i)
        if self.reduce_in_hook:
            launched = self._next
            self._launch_ready()
            if self.overlap:
                self.reduced_in_backward += self._next - launched

    def _launch_ready(self) -> None:
        groups = self.part.groups
        while self._next < len(groups) and groups[self._next].full:
            self._launch(groups[self._next])

    def _launch(self, g: Group) -> None:
        self._next += 1
        grad, out = self._reduce_pair(g)
        sent, received, land = self.wire.send(grad, out)
        with self.waits:   # without overlap_comm the reduce-scatter blocks here, in backward's hook
            handle = self.comm.reduce_scatter(received, sent, async_op=self.overlap)
        self._pending.append((handle, g, grad, out, land))
        self._reap(keep=MAX_IN_FLIGHT)

    def _reap(self, keep: int) -> None:
        """Finish reduce-scatters in launch order: those already done, and more until at most `keep` remain."""
        while self._pending:
            handle, g, grad, out, land = self._pending[0]
            if handle is not None:
                if len(self._pending) <= keep and not handle.is_completed():
                    return
                with self.waits:
                    handle.wait()
            self._pending.pop(0)
            land()
            self._reduced(g, grad, out)

    def reduce_gradients(self) -> None:
        """After backward: reduce what is left, wait for every reduce-scatter."""
        while self._next < len(self.part.groups):
            self._launch(self.part.groups[self._next])
        self._reap(keep=0)

    # ---- after the optimizer step: every rank's updated chunks to everyone

    def gather_params(self) -> None:
        """All-gather every bucket's updated chunks, at most `allgather_bucket_size` elements in flight."""
        handles: list[tuple[Any, torch.Tensor]] = []
        in_flight = 0
        for g in self.part.groups:
            if handles and in_flight + g.padded > self.allgather_numel:
                self._finish_gathers(handles)
                in_flight = 0
            # a copy of the chunk as input: the output region contains it, and not every backend allows aliasing
            mine = self._alloc(g.chunk, self.flat, "send")
            mine.copy_(self.part.flat_chunk(g, self.flat, self.rank))
            handles.append((self.comm.all_gather(self.part.flat_region(g, self.flat), mine, async_op=True), mine))
            in_flight += g.padded
        self._finish_gathers(handles)

    def _finish_gathers(self, handles: list[tuple[Any, torch.Tensor]]) -> None:
        for h, mine in handles:
            with self.waits:
                h.wait()
            self._release(mine, "send")
        handles.clear()

    def full_params(self, masters: list[torch.Tensor], keep: bool) -> dict[int, torch.Tensor]:
        """fp32 CPU copies of every parameter (id -> tensor), gathered bucket by bucket (each within one
        unit) from the ranks' fp32 chunks (`masters`, one per bucket); only a rank with `keep` (rank 0)
        keeps them. Collective."""
        return gather_fp32(self.comm, self.part, masters, keep)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
