"""A worker's top-k pushes (`train.compression = "topk"`): each partition it pushes (its gradient; in GEO its delta)
goes as its k largest
(index, value) pairs, k = ceil(topk_ratio x the partition's elements), and what it did not send is added to
the next push of that partition (error feedback, as DGC's and collective/compression.py's top-k)."""
from __future__ import annotations

import torch

from psarch.ps.sparse import largest


class TopKPushes:
    """The error feedback of every partition this worker pushes, and the selection of each push's pairs."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.error: dict[int, torch.Tensor] = {}

    def pairs(self, index: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 indices within the partition, values) of the k largest |grad + error| of partition `index`."""
        acc = grad + self.error[index] if index in self.error else grad.clone()
        keys = largest(acc, self.ratio)
        values = acc[keys]
        acc[keys] = 0
        self.error[index] = acc
        return keys, values

    def state_bytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self.error.values())
