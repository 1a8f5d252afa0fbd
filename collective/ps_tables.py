"""The hybrid (`backend.embeddings = "ps"` on ddp): the embedding tables on parameter servers, the dense layers
all-reduced, as recommendation systems train (PERSIA, HugeCTR, Monolith: embeddings on a PS, dense layers
data-parallel).

The ddp spec starts backend.servers PS servers as its services (psarch/ps/services.py, placed as the PS's), each
holding its shard of the tables by key (psarch/ps/rows.py) and no dense range (psarch/ps/server/rows.py,
tables_only). Each rank pulls the rows its batch reads before forward (`rowpull`, the PS worker's own path:
psarch/ps/worker/rows.py) and, after backward, pushes their gradients (`rowpush`), while ddp's buckets
all-reduce the dense gradient. Sync: a server applies a round's rows (their mean over ranks, row-wise
optimizer) once every rank's push for it is in, and answers a rank's next rowpull only then. Bytes per rank and
step: the dense all-reduce, plus the PS's rows (8·u of keys out twice, u·dim·b of rows in and out, and headers).

Checkpoints: each rank writes its part of the dense state (psarch.checkpoint.save), then asks every server to
write its part (the `save` op, psarch/ps/server/snapshots.py: a server writes its shard of the tables' rows and
their optimizer state once every rank asked, so after the step's round and before the next); rank 0 merges the
ranks' and the servers' parts and renames the folder. A resume or fork starts the servers from the checkpoint
(their rows read back from any layout: the servers' key mod S, a PS run's, a dense backend's whole tables) and
the ranks from its step; a checkpoint without every table's rows whole is refused (collective/spec.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from psarch.checkpoint import Checkpoint
from psarch.checkpoint.reader import CheckpointError
from psarch.config import Config
from psarch.dist import DistContext
from psarch.ps.errors import PSError
from psarch.ps.rows import server_config
from psarch.ps.worker.client import PSClient, Request
from psarch.ps.worker.rows import WorkerRows
from psarch.trainer import OpTraffic


class PSTableRows(WorkerRows):
    """A collective rank's embedding tables on the PS servers: the PS worker's rows (fetch before forward,
    their gradients taken after backward), pushed at once by `exchange` (no dense push to ride on)."""

    name = "ps"

    def __init__(self, model: nn.Module, cfg: Config, ctx: DistContext) -> None:
        """Takes the tables out of `model` (empty, frozen placeholders): call before the model moves."""
        ps = server_config(cfg)
        b = ps.backend
        addresses = list(ctx.services.addresses)
        if len(addresses) != b.servers:
            raise RuntimeError(f"backend.servers = {b.servers}: {len(addresses)} server address(es) known; "
                               f"backend.embeddings = \"ps\" runs through `psarch run`, which starts the servers")
        client = PSClient(addresses, ctx.rank, b.timeout_s, ctx.services.auth, b.heartbeat_s, b.heartbeat_timeout_s,
                          resend_s=b.resend_timeout_s)
        super().__init__(model, ps, client, torch.float32, ctx.device, ctx.rank)

    def exchange(self, batch: Any, grads: list[torch.Tensor]) -> dict[str, int]:
        """Push this step's rows' gradients to their servers (every server hears from every rank each step,
        with no rows if it owns none of the batch's: its round needs every rank)."""
        out = super().exchange(batch, grads)
        step = self.steps - 1
        self.client.exchange([[Request({"op": "rowpush", "step": step, "version": step}, self.grads[pos],
                                       keys=self.keys[pos])] for pos in self.where])
        return out

    def full_tables(self) -> dict[str, torch.Tensor]:
        """Rank 0's: the whole tables from the servers (the others' model state is not kept)."""
        return super().full_tables() if self.rank == 0 else {}

    # ------------------------------------------------------------------ checkpoints

    def params(self) -> dict[str, tuple[int, ...]]:
        """The tables (whole shapes), whose rows and optimizer state their servers write into each checkpoint."""
        return {name: (rows, self.space.dim) for name, rows in zip(self.table_names, self.space.rows)}

    def save_services(self, step: int, folder: Path) -> list[str]:
        """Every server writes its part of checkpoint `step` (its shard of the tables' rows, their optimizer state)
        into `folder` once every rank asked: after this step's round is applied, before any row of the next
        arrives, so the rows are the step the ranks' dense part is at; CheckpointError naming the checkpoint when a
        server refuses or does not answer within backend.timeout_s."""
        try:
            self.client.exchange([[Request({"op": "save", "step": step, "path": str(folder)})]
                                  for _ in range(self.space.servers)])
        except PSError as e:
            raise CheckpointError(f"checkpoint step {step} not written: {e}") from None
        return [f"server{i}" for i in range(self.space.servers)]

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        """The servers restored their rows and rounds from `ckpt` when they started: go on from its step."""
        self.steps = ckpt.step

    def traffic(self) -> dict[str, OpTraffic]:
        return self.client.meter.report().ops

    def close(self) -> None:
        self.client.close()
