"""ddp with `backend.embeddings = "rows"`: embedding tables' gradients move as (ids, rows), not whole.

Each rank all-gathers the distinct ids its batch touched in every table and their gradient rows; every
rank then sums the rows of all ranks (duplicate ids add up) into the table's gradient, whose other rows
stay zero. The result is the all-reduced dense gradient, so SGD, Adagrad and AdamW take exactly the
update of `embeddings = "dense"` (AdamW and momentum still move untouched rows, as they do dense).
This is what torch DDP does with `sparse=True` embeddings on gloo (its sparse all-reduce all-gathers
indices and values), on psarch's communicators and with its own bytes counted. The tables are made
`sparse=True` too, so backward adds only the batch's rows into the flat gradient (O(batch), not a dense
table-sized gradient); the optimizer still steps the whole flat buffer, as dense ddp does.

Wire, per step and rank, three all-gathers on the communicator (which moves flat float buffers; an
all-gather only copies, so int64 travels bit-exact as float64 views):
  1. counts: the number of distinct ids per table (T int64);
  2. ids: all tables' ids back to back, padded with -1 to the largest total U = max over ranks of Σ_t u_t
     (the communicators all-gather equal chunks, so every rank pays for the busiest rank's ids);
  3. rows: their gradient rows in the compute dtype, padded likewise to max over ranks of Σ_t u_t · dim_t.
Volume per rank (sent = received): (N-1) · (8 T + 8 U + b Σ_t u_t dim_t) with the maxima above;
`psarch.theory.rows_all_gather_bytes` is that formula.
"""
from __future__ import annotations

from typing import Any, Sequence, cast

import torch
from torch import nn

from collective.comm import Communicator
from psarch.embeddings import EmbeddingTables, embedding_tables, unique_ids


class RowExchange(EmbeddingTables):
    """The embedding tables of a model and the all-gather of their touched rows' gradients: the tables stay
    ordinary parameters of the model (the optimizer steps them with the rest), kept out of the buckets."""

    name = "rows"

    def __init__(self, model: nn.Module, comm: Communicator, cfg: Any = None,
                 device: torch.device | None = None) -> None:
        self.comm, self.model = comm, model
        for _, t in embedding_tables(model):  # backward adds the batch's rows into the flat gradient: O(batch)
            t.sparse = True

    def excluded(self) -> list[nn.Parameter]:
        """The tables' weights (read now: the model may have moved since construction)."""
        return [cast(nn.Parameter, t.weight) for _, t in embedding_tables(self.model)]   # torch types it Tensor

    def exchange(self, batch: Any, grads: Sequence[torch.Tensor]) -> dict[str, int]:
        """Replace each table's local gradient in `grads` (shaped like the tables) by the average over
        ranks, moving only touched rows; this rank's distinct ids over all tables (`unique_ids`)."""
        n, device = self.comm.world_size, grads[0].device
        ids = [i.to(device) for i in unique_ids(batch)]
        if len(ids) != len(grads):
            raise ValueError(f"a batch of {len(ids)} tables' ids for a model with {len(grads)} tables")
        counts = torch.tensor([len(i) for i in ids], dtype=torch.int64, device=device)
        every = _all_gather_int64(self.comm, counts).view(n, -1).tolist()
        width = max(sum(c) for c in every)
        dims = [g.shape[1] for g in grads]
        row_width = max(sum(u * d for u, d in zip(c, dims)) for c in every)
        dtype = grads[0].dtype
        # pre-divide by N, as the dense buckets do (keeps fp16 sums in range)
        rows = torch.cat([g[i].reshape(-1) for g, i in zip(grads, ids)]).div_(n)
        all_ids = _all_gather_int64(self.comm, _pad(torch.cat(ids), width, -1)).view(n, width)
        all_rows = torch.empty(n * row_width, dtype=dtype, device=device)
        self.comm.all_gather(all_rows, _pad(rows, row_width, 0))
        all_rows = all_rows.view(n, row_width)
        for g, i in zip(grads, ids):  # the gradient was zero but for this rank's rows
            g.index_fill_(0, i, 0)
        for r, c in enumerate(every):
            at = row_at = 0
            for g, u, d in zip(grads, c, dims):
                # index_add_ sums duplicate ids (the same row touched on several ranks)
                g.index_add_(0, all_ids[r, at:at + u], all_rows[r, row_at:row_at + u * d].view(u, d))
                at, row_at = at + u, row_at + u * d
        return {"unique_ids": int(counts.sum())}


def _pad(t: torch.Tensor, length: int, value: float) -> torch.Tensor:
    out = torch.full((length,), value, dtype=t.dtype, device=t.device)
    out[:t.numel()] = t
    return out


def _all_gather_int64(comm: Communicator, t: torch.Tensor) -> torch.Tensor:
    """All-gather an int64 buffer through a float communicator: bits copied as float64, never converted."""
    out = torch.empty(comm.world_size * t.numel(), dtype=torch.int64, device=t.device)
    comm.all_gather(out.view(torch.float64), t.view(torch.float64))
    return out
