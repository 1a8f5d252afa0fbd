"""Gradient buckets: consecutive ranges of the flat gradient buffer, all-reduced as soon as they fill."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class Bucket:
    """Parameters [first, last] of the flat layout, occupying elements [start, end) of the grad buffer."""

    index: int
    params: list[int]
    start: int
    end: int
    ready: set[int] = field(default_factory=set)

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)


def assign_buckets(params: Sequence[torch.Tensor], offsets: Sequence[int], cap_bytes: float) -> list[Bucket]:
    """Split params (in flat-buffer order) into buckets of at most `cap_bytes` (a larger parameter gets
    a bucket of its own). cap_bytes = 0 gives one bucket per parameter."""
    buckets: list[Bucket] = []
    cur: list[int] = []
    cur_bytes = 0
    for i, p in enumerate(params):
        size = p.numel() * p.element_size()
        if cur and cur_bytes + size > cap_bytes:
            buckets.append(_bucket(len(buckets), cur, params, offsets))
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += size
    if cur:
        buckets.append(_bucket(len(buckets), cur, params, offsets))
    return buckets


def _bucket(index: int, members: list[int], params: Sequence[torch.Tensor], offsets: Sequence[int]) -> Bucket:
    last = members[-1]
    return Bucket(index, members, offsets[members[0]], offsets[last] + params[last].numel())
