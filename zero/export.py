"""Checkpoint export: the consolidated fp32 model on rank 0, gathered one group at a time.

Every group lies within one unit (stage 3: a group is a unit; stages 1-2: buckets are cut at unit
boundaries), so no rank ever holds more than one unit's full parameters beyond rank 0's output, and
rank 0 holds that output once: each parameter is copied out of the gathered group straight to the CPU
(model.pt is a CPU fp32 state_dict) and used as it is (psarch.trainer.consolidated_state, copy=False)."""
from __future__ import annotations

import torch

from collective.comm import Communicator
from zero.partition import Partition


def gather_fp32(comm: Communicator, part: Partition, chunks: list[torch.Tensor], keep: bool) -> dict[int, torch.Tensor]:
    """All-gather each group's fp32 chunks (this rank's chunk of group i is chunks[i]), one group at a
    time; a rank with `keep` (rank 0) copies every parameter to the CPU (id -> tensor), the others drop
    each group at once."""
    out: dict[int, torch.Tensor] = {}
    for g, chunk in zip(part.groups, chunks):
        full = torch.empty(g.padded, dtype=torch.float32, device=chunk.device)
        comm.all_gather(full, chunk.detach().reshape(-1).float().contiguous())
        if keep:
            for p, v in zip(g.params, part.group_views(g, full)):
                out[id(p)] = v.to("cpu", copy=True)
        del full
    return out

