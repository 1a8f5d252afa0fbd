"""A worker's top-k pushes (`train.compression = "topk"`): each partition it pushes (its gradient; in GEO its delta)
goes as its k largest
(index, value) pairs, k = ceil(topk_ratio x the partition's elements), and what it did not send is added to
the next push of that partition (error feedback, as DGC's and collective/compression.py's top-k). On a virtual
device (`clock`, psarch/cluster/work_pacing.py) each selection is paced at what the prediction prices it
(psarch/ps/theory.py's compressing_bytes: passes over the partition at the device's memory bandwidth)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import Fragment
from psarch.ps.layout import Layout
from psarch.ps.snapshot import views
from psarch.ps.sparse import largest

if TYPE_CHECKING:
    from psarch.cluster.work_pacing import WorkClock

ERROR = "topk_error"   # a worker's error feedback in its checkpoint part, under "worker<R>/"


class TopKPushes:
    """The error feedback of every partition this worker pushes, and the selection of each push's pairs."""

    def __init__(self, ratio: float, nbytes: Callable[[int], float] = lambda numel: 0.0) -> None:
        self.ratio = ratio
        self.nbytes = nbytes                  # what a selection over `numel` elements moves in device memory
        self.clock: WorkClock | None = None   # a virtual device's (PSWorker.pace_work)
        self.error: dict[int, torch.Tensor] = {}

    def pairs(self, index: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 indices within the partition, values) of the k largest |grad + error| of partition `index`."""
        if self.clock is None:
            return self._pairs(index, grad)
        with self.clock.work(0.0, self.nbytes(grad.numel())):
            return self._pairs(index, grad)

    def _pairs(self, index: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = grad + self.error[index] if index in self.error else grad.clone()
        keys = largest(acc, self.ratio)
        values = acc[keys]
        acc[keys] = 0
        self.error[index] = acc
        return keys, values

    def state_bytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self.error.values())

    def fragments(self, own: str, layout: Layout, bounds: Sequence[tuple[int, int]]) -> list[Fragment]:
        """The error feedback of each partition pushed so far (`bounds`: each partition's [lo, hi) in the flat
        vector), as a checkpoint's fragments under `own`."""
        return [f for j in sorted(self.error) for f in views(layout, {own + ERROR: self.error[j]}, *bounds[j])]

    def restore(self, ckpt: Checkpoint, own: str, layout: Layout, bounds: Sequence[tuple[int, int]],
                parts: list[int], like: torch.Tensor) -> None:
        """The error feedback of partitions `parts` from a checkpoint (tensors like `like`: dtype and device)."""
        self.error = {j: like.new_zeros(bounds[j][1] - bounds[j][0]) for j in parts}
        with torch.no_grad():
            for j in parts:
                for f in views(layout, {own + ERROR: self.error[j]}, *bounds[j]):
                    ckpt.fill(f)
