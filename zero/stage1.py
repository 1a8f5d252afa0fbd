"""ZeRO stage 1: optimizer state partitioned; every rank keeps the full gradient.

A full flat gradient buffer laid out like the parameters (`param.grad` are views into it, as in DDP), so
autograd accumulates in place; each bucket is reduce-scattered as it fills (from the gradient hook with
overlap_comm, else after backward) and the rank's reduced chunk is copied back into its place in that
buffer, which then serves as the optimizer's gradient (gradients stay 1x the model, no extra shard buffer).
"""
from __future__ import annotations

import torch

from collective.comm import Communicator
from zero.partition import Group
from zero.stage12 import Stage12


class Stage1(Stage12):
    """ZeRO stage 1 on one rank: full parameters and gradients, this rank's chunk of the optimizer state."""

    def __init__(self, params: list[torch.nn.Parameter], comm: Communicator, reduce_bucket_size: int,
                 overlap_comm: bool, allgather_bucket_size: int = 5 * 10**8,
                 unit_of: dict[int, int] | None = None, compression: str = "none") -> None:
        super().__init__(params, comm, reduce_bucket_size, overlap_comm, allgather_bucket_size, unit_of, compression)
        self.reduce_in_hook = overlap_comm
        self.grad = torch.zeros_like(self.flat)
        for g in self.part.groups:
            for p, view in zip(g.params, self.part.group_views(g, self.part.flat_region(g, self.grad))):
                p.grad = view

    def grad_shards(self) -> list[torch.Tensor]:
        return [self.part.flat_chunk(g, self.grad, self.rank) for g in self.part.groups]

    def begin_step(self) -> None:
        self.grad.zero_()
        super().begin_step()

    def _take_grad(self, g: Group, i: int, p: torch.Tensor) -> None:
        pass  # autograd accumulated it into the full gradient buffer already

    def _reduce_pair(self, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        grad = self.part.flat_region(g, self.grad)
        return grad, self._alloc(g.chunk, grad)

    def _reduced(self, g: Group, input: torch.Tensor, output: torch.Tensor) -> None:
        self.part.flat_chunk(g, self.grad, self.rank).copy_(output)  # back into its place in the full buffer
        self._release(output)
