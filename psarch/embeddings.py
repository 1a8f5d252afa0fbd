"""Embedding tables and how a backend moves them (`backend.embeddings`): one interface, EmbeddingTables,
that each treatment implements — "dense" (the tables are ordinary parameters: nothing to do), "rows" (only
the rows a batch touched move: collective/rows.py, and the parameter server's psarch/ps/worker/rows.py, whose
workers fetch them from the servers), "sharded" (rows sharded over the ranks, exchanged by all-to-all:
collective/sharded.py), "ps" (the hybrid: a collective backend's tables on parameter servers:
collective/ps_tables.py) — and what every treatment shares: which parameters are the tables, and which rows a
batch touches.

Convention (the `dlrm` model on `clicks` data): a batch is (dense, ids, clicks) with ids of shape
(batch, tables, bag), and table t of the model (`model.tables[t]`, an nn.EmbeddingBag or nn.Embedding)
reads ids[:, t]. The expected count of distinct rows under the Zipf law is
`psarch.data.clicks.expected_unique` (theory uses it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from pathlib import Path

    from psarch.checkpoint.fragments import Fragment
    from psarch.trainer import OpTraffic


class EmbeddingTables:
    """How a worker's embedding tables live and move. A trainer holds one and calls every method at its
    place in the step, whatever the treatment: the defaults are the dense treatment's (the tables are
    ordinary parameters of the model, which the trainer's own machinery moves)."""

    name: ClassVar[str] = "dense"

    def excluded(self) -> list[nn.Parameter]:
        """Parameters this treatment moves itself: the trainer keeps them out of its dense exchange."""
        return []

    def fetch(self, batch: Any) -> Any:
        """Before forward: bring the rows this batch reads to where forward reads them; the batch forward
        reads (the PS's rows: its ids remapped to rows of the fetched tables)."""
        return batch

    def exchange(self, batch: Any, grads: list[torch.Tensor]) -> dict[str, int]:
        """After backward: move the tables' gradients (`grads`: the excluded parameters' gradients, in
        excluded() order) to where they are applied; this step's figures for its record (e.g. unique_ids)."""
        return {}

    def step(self) -> bool:
        """Update what this treatment holds itself (sharded rows); True when the update was skipped."""
        return False

    def full_tables(self) -> dict[str, torch.Tensor]:
        """Whole fp32 tables by parameter name, where the model does not hold them (a collective call)."""
        return {}

    def fragments(self) -> list["Fragment"]:
        """Checkpoint fragments of what this treatment holds itself."""
        return []

    def params(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> whole shape of what this treatment holds itself (what a checkpoint records)."""
        return {}

    def load_checkpoint(self, ckpt: Any) -> None:
        """Fill what this treatment holds itself from any checkpoint."""

    def save_services(self, step: int, folder: Path) -> list[str]:
        """Have the services that hold this treatment's state (the hybrid's PS servers) write their parts of
        checkpoint `step` into `folder`, the checkpoint's temporary folder (every rank asks, after its own part is
        written); the parts' names, which rank 0 merges with the ranks'."""
        return []

    def memory(self) -> dict[str, int]:
        """Bytes it holds itself, by MemoryReport category (added to the trainer's)."""
        return {}

    def traffic(self) -> dict[str, "OpTraffic"]:
        """Bytes it moved itself, by operation (added to the trainer's)."""
        return {}

    def modelled(self) -> bool:
        """Whether its bytes are the algorithm's volume rather than seen on the wire."""
        return False

    def summary(self) -> dict[str, float]:
        """Its figures for summary.json's extra (e.g. embedding bytes held against the whole tables)."""
        return {}

    def close(self) -> None:
        """Release what it holds open (the hybrid's connections to its servers)."""


def embedding_tables(model: nn.Module) -> list[tuple[str, nn.Embedding | nn.EmbeddingBag]]:
    """(parameter name of the weight, module) of each embedding table, in the model's table order."""
    tables = getattr(model, "tables", None)
    if not isinstance(tables, nn.ModuleList) or not all(isinstance(t, (nn.Embedding, nn.EmbeddingBag))
                                                            for t in tables):
        raise ValueError(f"{type(model).__name__} has no `tables` list of embeddings: embeddings other than "
                         f"dense need the dlrm model")
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(t.weight)], t) for t in tables if isinstance(t, (nn.Embedding, nn.EmbeddingBag))]


def batch_ids(batch: Any) -> torch.Tensor:
    """The ids of a (dense, ids, clicks) batch: int64 of shape (batch, tables, bag)."""
    ids = batch[1]
    if ids.dtype != torch.int64 or ids.dim() != 3:
        raise ValueError(f"ids of dtype {ids.dtype} and shape {tuple(ids.shape)}: expected int64 (batch, tables, bag)")
    return ids


def unique_ids(batch: Any) -> list[torch.Tensor]:
    """Per table, the sorted distinct ids the batch touches (the rows a step moves)."""
    ids = batch_ids(batch)
    return [torch.unique(ids[:, t].reshape(-1)) for t in range(ids.shape[1])]
