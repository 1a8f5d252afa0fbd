"""Partitioning arithmetic: parameter groups flattened, each padded to N equal chunks, chunk r on rank r.

A *group* is what one collective moves: a gradient bucket of at most `reduce_bucket_size` elements,
never spanning two units (stages 1 and 2), or a unit such as a transformer block (stage 3). Each group is padded to a multiple of N on its
own, as FSDP pads each flat parameter, so its reduce-scatter and all-gather are single equal-chunk
collectives; a rank's *shard* is its chunk of every group, concatenated. Padding is at most N - 1
elements per group and is reported as such. Pure arithmetic, no processes: unit-tested directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from zero.theory import padded_size


@dataclass
class Group:
    """Parameters `params` laid out at `offsets` (within the group), `numel` real elements padded to
    `padded`; the group starts at `flat_start` of a full flat buffer and its chunk at `shard_start`
    of a rank's shard buffer."""

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    padded: int
    flat_start: int
    shard_start: int
    world_size: int
    ready: set[int] = field(default_factory=set)   # params whose gradient arrived this step

    @property
    def chunk(self) -> int:
        """Elements of this group each rank owns."""
        return self.padded // self.world_size

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)

    def chunk_padding(self, rank: int) -> int:
        """Padding elements inside rank `rank`'s chunk (padding sits at the end of the group)."""
        lo, hi = rank * self.chunk, (rank + 1) * self.chunk
        return hi - min(max(self.numel, lo), hi)


class Partition:
    """Groups of parameters, each padded to a multiple of `world_size`; sizes of the full flat buffer
    (`padded_numel`) and of one rank's shard (`shard_numel` = padded_numel / world_size)."""

    def __init__(self, groups: Sequence[Sequence[torch.nn.Parameter]], world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.groups: list[Group] = []
        flat = shard = 0
        for i, params in enumerate(groups):
            offsets, n = [], 0
            for p in params:
                offsets.append(n)
                n += p.numel()
            padded = padded_size(n, world_size)
            self.groups.append(Group(i, list(params), offsets, n, padded, flat, shard, world_size))
            flat += padded
            shard += padded // world_size
        self.padded_numel, self.shard_numel = flat, shard
        self.numel = sum(g.numel for g in self.groups)

    @property
    def padding(self) -> int:
        """Padding elements over all groups (the full flat buffer's padding)."""
        return self.padded_numel - self.numel

    def shard_padding(self, rank: int) -> int:
        """Padding elements inside rank `rank`'s shard."""
        return sum(g.chunk_padding(rank) for g in self.groups)

    def group_views(self, group: Group, buf: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views into a buffer laid out like `group` alone (`padded` elements)."""
        return [buf[o:o + p.numel()].view_as(p) for o, p in zip(group.offsets, group.params)]

    def flat_region(self, group: Group, flat: torch.Tensor) -> torch.Tensor:
        """The group's `padded` elements of a full flat buffer."""
        return flat[group.flat_start:group.flat_start + group.padded]

    def flat_chunk(self, group: Group, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s chunk of the group, inside a full flat buffer."""
        start = group.flat_start + rank * group.chunk
        return flat[start:start + group.chunk]

    def group_chunk(self, group: Group, buf: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s chunk of a buffer laid out like `group` alone."""
        return buf[rank * group.chunk:(rank + 1) * group.chunk]

    def shard_chunk(self, group: Group, shard: torch.Tensor) -> torch.Tensor:
        """This group's chunk of a shard buffer (`shard_numel` elements)."""
        return shard[group.shard_start:group.shard_start + group.chunk]


def bucket_params(params: Sequence[torch.nn.Parameter], cap_numel: int,
                  unit_of: dict[int, int] | None = None) -> list[list[torch.nn.Parameter]]:
    """Consecutive params in groups of at most `cap_numel` elements (a larger parameter gets its own).

    With `unit_of` (id(param) -> unit), a group never holds parameters of two units: every group is then
    part of one unit, so moving the model group by group (checkpoint export) never holds more than one
    unit's parameters at once, whatever `cap_numel` is."""
    groups: list[list[torch.nn.Parameter]] = []
    cur: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        other_unit = unit_of is not None and cur and unit_of[id(p)] != unit_of[id(cur[-1])]
        if cur and (size + p.numel() > cap_numel or other_unit):
            groups.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel()
    if cur:
        groups.append(cur)
    return groups
