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
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from psarch.config import Config
from psarch.dist import DistContext
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
        client = PSClient(addresses, ctx.rank, b.timeout_s, ctx.services.auth, b.heartbeat_s, b.heartbeat_timeout_s)
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

    def traffic(self) -> dict[str, OpTraffic]:
        return self.client.meter.report().ops

    def close(self) -> None:
        self.client.close()
