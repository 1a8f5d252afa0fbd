"""ZeRO stage 2: optimizer state and gradients partitioned; no rank keeps the full gradient.

Only a shard-sized gradient buffer is kept. Each gradient autograd produces is copied into its bucket's
buffer and dropped at once (`param.grad = None`); a full bucket is reduce-scattered straight into the
shard (asynchronously with overlap_comm, which DeepSpeed runs on a side stream; here the communicator's
thread, else blocking inside the hook, so still only one bucket is held).
A bucket's buffer is allocated at its first gradient and freed once its reduce-scatter has finished;
at most MAX_IN_FLIGHT reduce-scatters are in flight, so few buckets are ever held (psarch.meters.Transient
books them: the 'grads' peak).
"""
from __future__ import annotations

import torch

from collective.comm import Communicator
from zero.partition import Group
from zero.stage12 import Stage12


class Stage2(Stage12):
    """ZeRO stage 2 on one rank: full parameters, this rank's chunk of the gradients and optimizer state."""

    reduce_in_hook = True  # even without overlap (then blocking), so only one bucket is ever held

    def __init__(self, params: list[torch.nn.Parameter], comm: Communicator, reduce_bucket_size: int,
                 overlap_comm: bool, allgather_bucket_size: int = 5 * 10**8,
                 unit_of: dict[int, int] | None = None, compression: str = "none") -> None:
        super().__init__(params, comm, reduce_bucket_size, overlap_comm, allgather_bucket_size, unit_of, compression)
        self.shard_grad = torch.zeros(self.part.shard_numel, dtype=self.flat.dtype, device=self.flat.device)
        self._held: dict[int, torch.Tensor] = {}      # group index -> its buffer, from first gradient to reduced

    def grad_shards(self) -> list[torch.Tensor]:
        return [self.part.shard_chunk(g, self.shard_grad) for g in self.part.groups]

    def _buffer(self, g: Group) -> torch.Tensor:
        """Bucket g's buffer (its `padded` elements), allocated at its first gradient."""
        buf = self._held.get(g.index)
        if buf is None:
            buf = self._held[g.index] = self._alloc(g.padded, self.flat)
            buf[g.numel:].zero_()  # padding; each parameter's region is written by its gradient
        return buf

    def _take_grad(self, g: Group, i: int, p: torch.Tensor) -> None:
        assert p.grad is not None   # called from p's post-accumulate-grad hook
        with torch.no_grad():
            self._buffer(g)[g.offsets[i]:g.offsets[i] + p.numel()].view_as(p).copy_(p.grad)
        p.grad = None  # stage 2 keeps no full gradient

    def _reduce_pair(self, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        grad = self._buffer(g)
        for i, view in enumerate(self.part.group_views(g, grad)):
            if i not in g.ready:  # a parameter that got no gradient (or a bucket none reached) adds zeros
                view.zero_()
        return grad, self.part.shard_chunk(g, self.shard_grad)

    def _reduced(self, g: Group, input: torch.Tensor, output: torch.Tensor) -> None:
        self._release(self._held.pop(g.index))
