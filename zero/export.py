"""Checkpoint export: the consolidated fp32 model on rank 0, gathered one group (unit) at a time."""
from __future__ import annotations

import torch

from collective.comm import Communicator
from zero.partition import Partition


def gather_fp32(comm: Communicator, part: Partition, chunks: list[torch.Tensor], keep: bool) -> dict[int, torch.Tensor]:
    """All-gather each group's fp32 chunks (this rank's chunk of group i is chunks[i]), one group at a
    time; a rank with `keep` (rank 0) copies out every parameter (id -> tensor), the others drop each
    group at once, so no rank holds more than one group's full parameters beyond rank 0's output."""
    out: dict[int, torch.Tensor] = {}
    for g, chunk in zip(part.groups, chunks):
        full = torch.empty(g.padded, dtype=torch.float32, device=chunk.device)
        comm.all_gather(full, chunk.detach().reshape(-1).float().contiguous())
        if keep:
            for p, v in zip(g.params, part.group_views(g, full)):
                out[id(p)] = v.clone()
        del full
    return out
