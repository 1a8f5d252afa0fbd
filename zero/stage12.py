"""ZeRO stages 1 and 2: every rank holds the full parameters; gradients are reduce-scattered to their owners.

Parameters live in one flat buffer, in reverse registration order (gradients become ready roughly in
that order), cut into buckets of at most `reduce_bucket_size` elements, and also where one unit's
parameters end and another's begin (zero.units), so that checkpoint export, which moves the model bucket
by bucket, never holds more than one unit's full parameters at once; each bucket is padded to a multiple of N
and rank r owns chunk r of every bucket (zero.partition). After backward each rank holds the averaged
gradient of its chunks only, its optimizer updates them, and the updated chunks are all-gathered back
into every rank's full buffer: reduce-scatter + all-gather = 2(N-1)/N of the (padded) bytes, per step.
The all-gathers go bucket by bucket, as many in flight as fit in `allgather_bucket_size` elements.

Stage 1 keeps a full flat gradient buffer (`param.grad` are views into it, as in DDP) and reduce-scatters
each bucket as it fills; the rank's reduced chunk is copied back into its place in that buffer, which
then serves as the optimizer's gradient (so gradients stay 1x the model, no extra shard buffer).
Stage 2 keeps only a shard-sized gradient buffer: each gradient autograd produces is copied into its
bucket's transient buffer and dropped at once; a full bucket is reduce-scattered straight into the
shard (asynchronously with overlap_comm, which DeepSpeed runs on a side stream; here the communicator's
thread), and its buffer is freed when that finishes. Transient buffers are reported as working memory,
gradient buckets also on their own (psarch.meters.Transient).
"""
from __future__ import annotations

from typing import Any

import torch

from collective.comm import Communicator
from psarch.meters import Transient
from zero.export import gather_fp32
from zero.partition import Group, Partition, bucket_params

# Reduce-scatters left in flight when a new one is launched; beyond that the oldest is waited for. Bounds
# the transient gradient buffers, as DeepSpeed bounds its reduction buckets by double-buffering them.
MAX_IN_FLIGHT = 2


class Stage12:
    """Flat full parameters and partitioned gradients for ZeRO stage 1 or 2 on one rank."""

    def __init__(self, params: list[torch.nn.Parameter], comm: Communicator, stage: int,
                 reduce_bucket_size: int, overlap_comm: bool, allgather_bucket_size: int = 5 * 10**8,
                 unit_of: dict[int, int] | None = None) -> None:
        if stage not in (1, 2):
            raise ValueError(f"Stage12 runs stage 1 or 2, got {stage}")
        self.comm, self.stage, self.overlap = comm, stage, overlap_comm
        self.allgather_numel = allgather_bucket_size
        self.rank, self.n = comm.rank, comm.world_size
        params = params[::-1]
        self.part = Partition(bucket_params(params, reduce_bucket_size, unit_of), self.n)
        dtype, device = params[0].dtype, params[0].device
        self.flat = torch.zeros(self.part.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for g in self.part.groups:
                for p, view in zip(g.params, self.part.group_views(g, self.part.flat_region(g, self.flat))):
                    view.copy_(p.data)
                    p.data = view
        comm.broadcast(self.flat, src=0)  # every rank starts from rank 0's parameters
        if stage == 1:
            self.grad = torch.zeros_like(self.flat)
            for g in self.part.groups:
                for p, view in zip(g.params, self.part.group_views(g, self.part.flat_region(g, self.grad))):
                    p.grad = view
        else:
            self.shard_grad = torch.zeros(self.part.shard_numel, dtype=dtype, device=device)
        self._group_of = {id(p): g for g in self.part.groups for p in g.params}
        self._index_in_group = {id(p): i for g in self.part.groups for i, p in enumerate(g.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._buffers: dict[int, torch.Tensor] = {}       # stage 2: buckets being filled
        self._pending: list[tuple[Any, Group, torch.Tensor]] = []
        self._next = 0
        self.transient = Transient()
        self.reduced_in_backward = 0   # asynchronous reduce-scatters launched from gradient hooks: the overlap

    # ---- what the optimizer sees: this rank's chunks

    def param_shards(self) -> list[torch.Tensor]:
        return [self.part.flat_chunk(g, self.flat, self.rank) for g in self.part.groups]

    def grad_shards(self) -> list[torch.Tensor]:
        if self.stage == 1:
            return [self.part.flat_chunk(g, self.grad, self.rank) for g in self.part.groups]
        return [self.part.shard_chunk(g, self.shard_grad) for g in self.part.groups]

    # ---- backward: gradients into buckets, full buckets reduce-scattered in bucket order

    def begin_step(self) -> None:
        if self.stage == 1:
            self.grad.zero_()
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
        if self.stage == 2:
            buf = self._buffers.get(g.index)
            if buf is None:
                buf = self._buffers[g.index] = self._alloc(g.padded, self.flat)
                buf[g.numel:].zero_()  # padding; each parameter's region is written by its gradient
            with torch.no_grad():
                buf[g.offsets[i]:g.offsets[i] + p.numel()].copy_(p.grad.view(-1))
            p.grad = None  # stage 2 keeps no full gradient
        g.ready.add(i)
        # Stage 2 reduces from the hook even without overlap (blocking), so only one bucket is ever held.
        if self.overlap or self.stage == 2:
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
        if self.stage == 1:
            grad = self.part.flat_region(g, self.grad)
            out = self._alloc(g.chunk, grad)
        else:
            grad = self._buffers.pop(g.index, None)
            if grad is None:  # no parameter of this bucket got a gradient: reduce zeros, like everyone
                grad = self._alloc(g.padded, self.flat).zero_()
            for i, view in enumerate(self.part.group_views(g, grad)):
                if i not in g.ready:  # a parameter that got no gradient contributes zeros
                    view.zero_()
            out = self.part.shard_chunk(g, self.shard_grad)
        grad.div_(self.n)  # average by pre-dividing (keeps fp16 sums in range), as DDP does
        handle = self.comm.reduce_scatter(out, grad, async_op=self.overlap)
        self._pending.append((handle, g, out if self.stage == 1 else grad))
        self._reap(keep=MAX_IN_FLIGHT)

    def _reap(self, keep: int) -> None:
        """Finish reduce-scatters in launch order: those already done, and more until at most `keep` remain."""
        while self._pending:
            handle, g, buf = self._pending[0]
            if handle is not None:
                if len(self._pending) <= keep and not handle.is_completed():
                    return
                handle.wait()
            self._pending.pop(0)
            if self.stage == 1:  # the reduced chunk goes back into its place in the full gradient buffer
                self.part.flat_chunk(g, self.grad, self.rank).copy_(buf)
            self._release(buf)

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

