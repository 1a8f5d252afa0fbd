"""The embedding treatments of the collective backends (psarch.embeddings.EmbeddingTables): ddp runs dense,
rows (collective/rows.py: the touched rows' gradients all-gathered), sharded (collective/sharded.py: rows
sharded over the ranks, all-to-all) and ps (collective/ps_tables.py: the tables on parameter servers); torch_ddp runs dense and rows (TorchSparseRows: torch's own sparse
gradients, which DDP's reducer all-gathers on gloo)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from collective.comm import Communicator
from collective.rows import RowExchange
from collective.sharded import ShardedTables
from collective.theory import rows_all_gather_bytes
from psarch.dist import DistContext
from psarch.embeddings import EmbeddingTables, embedding_tables, unique_ids
from psarch.meters import TrafficMeter
from psarch.trainer import OpTraffic

TREATMENTS: dict[str, Callable[..., EmbeddingTables]] = {"dense": EmbeddingTables, "rows": RowExchange,
                                                "sharded": ShardedTables}


def make_tables(model: nn.Module, comm: Communicator, cfg: Any, ctx: DistContext) -> EmbeddingTables:
    """The treatment backend.embeddings names, built before the model moves to its device (sharded and ps take
    the tables out of the model first)."""
    if cfg.backend.embeddings == "ps":   # the hybrid: the tables on the PS servers the spec started
        from collective.ps_tables import PSTableRows
        return PSTableRows(model, cfg, ctx)
    device = ctx.device
    kind = TREATMENTS[cfg.backend.embeddings]
    return kind() if kind is EmbeddingTables else kind(model, comm, cfg, device)


class TorchSparseRows(EmbeddingTables):
    """torch_ddp with embeddings = "rows": the tables get sparse gradients (nn.EmbeddingBag(sparse=True)),
    which DDP's reducer sums on gloo by all-gathering their (indices, values); torch's fused optimizers
    refuse them (the spec refuses what torch's others do). Its bytes are gloo's, so they are modelled:
    all-gathers of metadata, indices and values, each rank's own u, unpadded."""

    name = "rows"

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.tables = [t for _, t in embedding_tables(model)]
        for t in self.tables:
            t.sparse = True
        torch.sparse.check_sparse_tensor_invariants.disable()   # torch's sparse Adagrad builds them unchecked
        self.n = world_size
        self.meter = TrafficMeter(modelled=True)

    def exchange(self, batch: Any, grads: list[torch.Tensor]) -> dict[str, int]:
        """DDP's reducer moved the rows during backward: count the bytes it moved."""
        u = [len(i) for i in unique_ids(batch)]
        rows = rows_all_gather_bytes(self.n, len(u), sum(u), sum(c * t.embedding_dim for c, t in zip(u, self.tables)),
                                     self.tables[0].weight.element_size())
        self.meter.add("all_gather", int(rows), int(rows))
        return {"unique_ids": sum(u)}

    def traffic(self) -> dict[str, OpTraffic]:
        return self.meter.report().ops

    def modelled(self) -> bool:
        return True
