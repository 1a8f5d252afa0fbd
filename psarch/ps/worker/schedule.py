"""Pushes started from backward (`backend.overlap_comm`): each partition of the flat gradient is pushed as soon as
its gradients are final, in the order backward finishes them, as DDP launches its buckets (collective/ddp.py).

A post-accumulate-grad hook on every parameter counts down the partitions the parameter overlaps; a partition
whose count reaches zero is handed to `post` at once, while backward goes on (ZeroMQ's I/O thread sends it).
`finish`, after backward, posts the partitions whose parameters got no gradient (their zeros still travel:
a server's round needs every partition). Replies are taken only after backward, never into parameters that
backward still reads.
"""
from __future__ import annotations

import bisect
from typing import Callable, Sequence

import torch

from psarch.ps.worker.link import Part


class PushSchedule:
    """Which partitions each parameter's gradient completes, and the countdown of one backward."""

    def __init__(self, params: Sequence[torch.nn.Parameter], offsets: Sequence[int], parts: Sequence[Part]) -> None:
        self.parts = list(parts)
        starts = [p.lo for p in self.parts]
        self.covers: list[list[int]] = []     # per parameter: the partitions its elements fall in
        for param, off in zip(params, offsets):
            first = bisect.bisect_right(starts, off) - 1
            last = bisect.bisect_right(starts, off + param.numel() - 1) - 1
            self.covers.append(list(range(first, last + 1)))
        self.need = [0] * len(self.parts)
        for cover in self.covers:
            for j in cover:
                self.need[j] += 1
        self.left: list[int] = []
        self.done: set[int] = set()            # parameters whose gradient is final this backward
        self.posted: list[bool] = []
        self.post: Callable[[Part], None] | None = None
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def arm(self, post: Callable[[Part], None]) -> None:
        """The next backward posts each partition through `post` once its gradients are final."""
        self.left, self.posted, self.post = list(self.need), [False] * len(self.parts), post
        self.done.clear()

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad_ready(param: torch.Tensor) -> None:
            if self.post is None:
                return
            if i in self.done:
                raise RuntimeError("ps overlap_comm: a parameter received its gradient twice in one backward "
                                   "(reentrant backward or activation checkpointing); set backend.overlap_comm = false")
            self.done.add(i)
            for j in self.covers[i]:
                self.left[j] -= 1
                if not self.left[j]:
                    self._post(j)
        return on_grad_ready

    def _post(self, j: int) -> None:
        assert self.post is not None   # armed: the hook does nothing before arm(), and finish() follows it
        self.posted[j] = True
        self.post(self.parts[j])

    def finish(self) -> int:
        """After backward: post every partition still waiting (parameters without a gradient); how many were."""
        late = [j for j, done in enumerate(self.posted) if not done]
        for j in late:
            self._post(j)
        self.post = None
        return len(late)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
