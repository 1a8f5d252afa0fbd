"""A tensor-parallel rank's state in the full model's terms: its shards as checkpoint fragments (by the full
parameter's name and flat offset, so any backend at any world size reads them), and the full model gathered
from every tensor-parallel rank's shards."""
from __future__ import annotations

import torch

from collective.tensor.mesh import TensorMesh
from collective.tensor.split import Shard, shard_plan
from psarch.checkpoint.fragments import PARAM, Fragment, optimizer_views, share_of


def local_layout(plan: dict[str, Shard]) -> list[tuple[str, int, int]]:
    """(name, offset, numel) of each local part in a rank's flat buffer: the model's order, no gaps."""
    out, at = [], 0
    for name, shard in plan.items():
        numel = torch.Size(shard.local_shape).numel()
        out.append((name, at, numel))
        at += numel
    return out


def fragments(plan: dict[str, Shard], optimizer: torch.optim.Optimizer, master: torch.Tensor) -> list[Fragment]:
    """Every fragment this rank holds: its part of each parameter, the fp32 master (one flat tensor, holder 0)
    and the optimizer's state of it."""
    state, scalars = optimizer_views(optimizer, master)
    flat = {PARAM: master.detach().view(-1), **state}
    out = []
    for name, at, numel in local_layout(plan):
        out += plan[name].fragments({k: t[at:at + numel] for k, t in flat.items()}, scalars)
    return out


def written_by_me(frags: list[Fragment], plan: dict[str, Shard], rank: int, world_size: int, dp_rank: int,
                  dp_size: int) -> list[Fragment]:
    """The fragments this rank writes: replicated parameters are held by every rank and dealt among all of them;
    a tensor-parallel part is held by its dp_size data-parallel replicas and dealt among those."""
    replicated = [f for f in frags if plan[f.name].dim is None]
    split = [f for f in frags if plan[f.name].dim is not None]
    return share_of(replicated, rank, world_size) + share_of(split, dp_rank, dp_size)


def gather_full(shapes: dict[str, tuple[int, ...]], master: torch.Tensor, mesh: TensorMesh,
                keep: bool) -> dict[str, torch.Tensor]:
    """The full fp32 model on the CPU, from every tensor-parallel rank's flat master (a collective call within the
    tensor-parallel group: each rank's buffer padded to the longest, all-gathered); {} where not `keep`."""
    plans = [shard_plan(shapes, mesh.tp_size, r) for r in range(mesh.tp_size)]
    longest = max(sum(numel for _, _, numel in local_layout(p)) for p in plans)
    mine = torch.zeros(longest, dtype=torch.float32, device=master.device)
    mine[:master.numel()] = master.detach().view(-1)
    if mesh.tp is not None:
        with mesh.tp.traffic.tagged("export"):   # no training step's traffic: booked as export_all_gather
            every = mesh.tp_all_gather(mine)
    else:
        every = mine.view(1, -1)
    if not keep:
        return {}
    every = every.cpu()
    full = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    for r, plan in enumerate(plans):
        for name, at, numel in local_layout(plan):
            plan[name].put(full[name], every[r, at:at + numel].view(plan[name].local_shape))
    return full
