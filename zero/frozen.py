"""ZeRO-3's frozen weights (train.trainable, LoRA's base weights): sharded like the parameters that train.

Each unit's frozen parameters form one group of their own partition (zero.partition), padded to N chunks; a
rank keeps its chunk of every group (`shard`, 1/N of the frozen weights) and the unit's full buffer exists
only while the unit is gathered, its storage resized to 0 when freed (the parameters are views into it, as
the trainable ones are into theirs). Stage 3 gathers them with their unit, in forward and again in backward
where backward reaches the unit (zero/stage3.py), as FSDP2 all-gathers a unit's frozen parameters with the rest;
they have no gradient, no optimizer state
and no reduce-scatter. A unit with no frozen parameter (or only empty placeholders) has no group and moves
nothing more.
"""
from __future__ import annotations

import torch

from collective.comm import Communicator, Handle
from psarch.model_units import Unit
from zero.export import gather_fp32
from zero.partition import Group, Partition


class FrozenShards:
    """This rank's chunk of each unit's frozen parameters, and the unit's full buffer while gathered."""

    def __init__(self, units: list[Unit], comm: Communicator) -> None:
        self.comm, self.rank = comm, comm.rank
        held = [i for i, u in enumerate(units) if sum(p.numel() for p in u.frozen)]
        self.part = Partition([units[i].frozen for i in held], comm.world_size)
        self.group: dict[int, Group] = dict(zip(held, self.part.groups))   # unit index -> its frozen group
        first = units[held[0]].frozen[0] if held else torch.empty(0)
        self.shard = torch.zeros(self.part.shard_numel, dtype=first.dtype, device=first.device)
        self.full: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for i, g in self.group.items():
                full = torch.zeros(g.padded, dtype=first.dtype, device=first.device)
                for p, view in zip(g.params, self.part.group_views(g, full)):
                    view.copy_(p.data)
                    p.data = view
                comm.broadcast(full, src=0)  # every rank starts from rank 0's weights, as with those that train
                self.part.shard_chunk(g, self.shard).copy_(self.part.group_chunk(g, full, self.rank))
                full.untyped_storage().resize_(0)
                self.full[i] = full

    def gather(self, i: int) -> Handle:
        """Start the all-gather of unit i's frozen weights (it holds some) into its full buffer, which the caller
        has allocated."""
        g = self.group[i]
        handle = self.comm.all_gather(self.full[i], self.part.shard_chunk(g, self.shard), async_op=True)
        assert handle is not None   # async_op=True returns a Handle
        return handle

    def numel(self, i: int) -> int:
        """Elements of unit i's full frozen buffer while gathered (padding included)."""
        g = self.group.get(i)
        return 0 if g is None else g.padded

    def full_params(self, keep: bool) -> dict[int, torch.Tensor]:
        """fp32 CPU copies of the frozen weights (id -> tensor) on ranks with `keep`, one unit at a time. Collective."""
        return gather_fp32(self.comm, self.part, [self.part.shard_chunk(g, self.shard) for g in self.part.groups],
                           keep)
