"""What every sparse path shares: which parameters are embedding tables, and which rows a batch touches.

Convention (the `dlrm` model on `clicks` data): a batch is (dense, ids, clicks) with ids of shape
(batch, tables, bag), and table t of the model (`model.tables[t]`, an nn.EmbeddingBag or nn.Embedding)
reads ids[:, t]. `backend.embeddings = "rows"` / `"sharded"` move only the rows in `unique_ids(batch)`.
The expected count under the Zipf law is `psarch.data.clicks.expected_unique` (theory uses it).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def embedding_tables(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(parameter name of the weight, module) of each embedding table, in the model's table order."""
    tables = getattr(model, "tables", None)
    if not isinstance(tables, nn.ModuleList) or not all(isinstance(t, (nn.Embedding, nn.EmbeddingBag))
                                                            for t in tables):
        raise ValueError(f"{type(model).__name__} has no `tables` list of embeddings: sparse embeddings "
                         f"need the dlrm model")
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(t.weight)], t) for t in tables]


def batch_ids(batch: Any) -> torch.Tensor:
    """The ids of a (dense, ids, clicks) batch: int64 of shape (batch, tables, bag)."""
    ids = batch[1]
    if ids.dtype != torch.int64 or ids.dim() != 3:
        raise ValueError(f"ids of dtype {ids.dtype} and shape {tuple(ids.shape)}: expected int64 (batch, tables, bag)")
    return ids


def unique_ids(batch: Any) -> list[torch.Tensor]:
    """Per table, the sorted distinct ids the batch touches (the rows a sparse step moves)."""
    ids = batch_ids(batch)
    return [torch.unique(ids[:, t].reshape(-1)) for t in range(ids.shape[1])]
