"""The dp x t grid of ranks: tensor-parallel ranks adjacent (global rank = dp_rank · t + tp_rank, as Megatron
lays them out, so a tensor-parallel group shares a machine where one holds several), one tensor-parallel
group per data-parallel replica and one data-parallel group per tensor-parallel rank. One object computes the
ranks, groups and communicators once and is passed explicitly."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from collective.communicators import make_communicator
from collective.comm import Communicator
from psarch.dist import DistContext
from psarch.meters import WaitClock
from psarch.trainer import OpTraffic, TrafficReport


def grid(rank: int, world_size: int, tp_size: int) -> tuple[int, int]:
    """(dp_rank, tp_rank) of global rank `rank`."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tensor_parallel = {tp_size} must divide world_size = {world_size}")
    return rank // tp_size, rank % tp_size


@dataclass
class TensorMesh:
    """This rank's place in the grid, and the communicators of its two groups (None where a group is this rank
    alone: nothing to communicate). `waits` times every tensor-parallel collective, which blocks inside forward
    and backward."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    tp: Communicator | None = None
    dp: Communicator | None = None
    waits: WaitClock = field(default_factory=WaitClock)

    @classmethod
    def build(cls, ctx: DistContext, tp_size: int, comm: str) -> "TensorMesh":
        """Create every group of the grid (each rank creates all of them, in the same order, as
        torch.distributed requires) and a `comm` communicator ("ring" or "native") on each of this rank's."""
        if ctx.group is not None:
            raise ValueError("tensor parallelism builds its groups from the default process group; "
                             "DistContext.group must be None")
        n = ctx.world_size
        dp_rank, tp_rank = grid(ctx.rank, n, tp_size)
        mesh = cls(tp_rank, tp_size, dp_rank, n // tp_size)
        if n == 1:
            return mesh
        tp_groups = [list(range(d * tp_size, (d + 1) * tp_size)) for d in range(n // tp_size)]
        dp_groups = [list(range(r, n, tp_size)) for r in range(tp_size)]
        for ranks in tp_groups + dp_groups:
            group = dist.new_group(ranks)
            if ctx.rank in ranks and len(ranks) > 1:
                which = "tp" if ranks in tp_groups else "dp"
                setattr(mesh, which, make_communicator(comm, group))
        return mesh

    # ---- collectives (no-ops in a group of one)

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a contiguous tensor over the tensor-parallel group, in place; returns it. The communicator works on
        a detached view (its thread must not meet autograd's view tracking)."""
        if self.tp is not None:
            with self.waits:
                self.tp.all_reduce(x.detach().view(-1))
        return x

    def tp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every tensor-parallel rank's 1-D `x`, stacked in rank order: (tp_size, len(x))."""
        if self.tp is None:
            return x.view(1, -1)
        out = torch.empty(self.tp_size * x.numel(), dtype=x.dtype, device=x.device)
        with self.waits:
            self.tp.all_gather(out, x.detach().contiguous())
        return out.view(self.tp_size, -1)

    def dp_all_reduce(self, flat: torch.Tensor) -> None:
        """Sum a flat buffer over the data-parallel group, in place."""
        if self.dp is not None:
            self.dp.all_reduce(flat)

    # ---- reports

    def traffic(self) -> TrafficReport:
        """Both groups' traffic, each operation prefixed by its group: tp_all_reduce (activations),
        tp_all_gather (the loss), dp_all_reduce (gradients); export_* for gathers that are no step's."""
        ops: dict[str, OpTraffic] = {}
        modelled = False
        for prefix, comm in (("tp", self.tp), ("dp", self.dp)):
            if comm is None:
                continue
            report = comm.traffic.report()
            modelled = modelled or report.modelled
            for op, o in report.ops.items():
                tag, _, base = op.partition("_") if op.startswith("export_") else ("", "", op)
                ops[f"{tag + '_' if tag else ''}{prefix}_{base}"] = o
        return TrafficReport(ops, modelled)

    def close(self) -> None:
        for comm in (self.tp, self.dp):
            if comm is not None:
                comm.close()
