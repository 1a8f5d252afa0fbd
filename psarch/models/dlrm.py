"""DLRM (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and Recommendation
Systems"): one embedding bag per sparse feature, a bottom MLP over the dense features, a pairwise-dot or
concat interaction of the resulting vectors, and a top MLP to one click logit, trained with binary
cross-entropy.

Two choices differ from the reference code, so that the hidden model of `clicks` data (a logistic
model: bias + linear dense term + one weight per row) is exactly representable with interaction "cat"
and no hidden layers: the bottom MLP's output layer has no ReLU, and bags are mean-pooled (the logit's
scale does not grow with the bag size).

Table t's initial values come from their own generators, one per block of TABLE_BLOCK rows (seeded from the
config seed, t and the block), not from torch's global generator: the dense layers start the same whether or
not the tables were built, and a process that holds only some rows (a row server, a sharded rank) computes
exactly those rows, a block at a time, without ever holding the table (`table_rows`).
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _mlp(widths: Sequence[int], last_relu: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


TABLE_BLOCK = 1 << 16   # rows per generator: bounds the memory of computing any subset of a table's rows
_TABLE_STREAM = 0x7AB1E  # keeps the tables' generators apart from the data's (psarch.data.step_generator)


def _table_block(seed: int, table: int, rows: int, dim: int, block: int) -> torch.Tensor:
    """Initial values of rows [block * TABLE_BLOCK, ...) of `table`: the reference code's U(-sqrt(1/rows),
    sqrt(1/rows)), from a generator of its own."""
    key = np.random.SeedSequence([seed, _TABLE_STREAM, table, block]).generate_state(2, np.uint32)
    g = torch.Generator().manual_seed(int(key[0]) << 31 | int(key[1]) >> 1)
    n = min(rows, (block + 1) * TABLE_BLOCK) - block * TABLE_BLOCK
    return torch.empty(n, dim, device="cpu").uniform_(-rows ** -0.5, rows ** -0.5, generator=g)


def table_rows(seed: int, table: int, rows: int, dim: int, start: int = 0, step: int = 1) -> Iterator[torch.Tensor]:
    """Initial values of rows start, start + step, ... (< rows) of `table`, in order, one chunk of at most
    TABLE_BLOCK rows at a time; bit-identical to the rows of a materialised DLRM table."""
    if not (0 <= start and step >= 1):
        raise ValueError(f"rows start={start}, step={step}: expected start >= 0 and step >= 1")
    for block in range(-(-rows // TABLE_BLOCK)):
        lo = block * TABLE_BLOCK
        first = start if start >= lo else lo + (start - lo) % step   # the block's first wanted row
        if first < min(rows, lo + TABLE_BLOCK):
            yield _table_block(seed, table, rows, dim, block)[first - lo::step].clone()


def _whole_table(seed: int, table: int, rows: int, dim: int) -> torch.Tensor:
    out, pos = torch.empty(rows, dim, device="cpu"), 0
    for chunk in table_rows(seed, table, rows, dim):   # filled in place: never two copies of the table
        out[pos:pos + chunk.shape[0]] = chunk
        pos += chunk.shape[0]
    return out


class DLRM(nn.Module):
    """Click logit from dense features (batch, num_dense) and ids (batch, num_tables, bag)."""

    def __init__(self, num_dense: int, num_tables: int, rows: int, dim: int, bottom_mlp: Sequence[int] = (64,),
                 top_mlp: Sequence[int] = (64,), interaction: str = "dot", seed: int = 0,
                 tables: bool = True) -> None:
        """tables=False: the tables stay on the meta device (shapes, no memory), for a process that never
        holds them (a PS worker with backend.embeddings = "rows", a ddp rank with "sharded", which keeps only
        its own rows); their values are `table_rows`'."""
        super().__init__()
        if interaction not in ("dot", "cat"):
            raise ValueError(f"interaction = {interaction!r}: allowed values are \"dot\", \"cat\"")
        self.interaction, self.seed = interaction, seed
        # built on meta first: a table is never allocated (nor drawn from the global generator) twice
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="mean", device="meta") for _ in range(num_tables))
        n = num_tables + 1  # the bottom MLP's output is one more vector beside the embeddings
        top_in = dim + n * (n - 1) // 2 if interaction == "dot" else n * dim
        # ZeRO's units, in forward order; the tables form the root unit
        self.blocks = nn.ModuleList([_mlp([num_dense, *bottom_mlp, dim]), _mlp([top_in, *top_mlp, 1])])
        device = next(self.blocks.parameters()).device   # the caller's device (torch.device context), meta included
        if tables and device.type != "meta":
            for i, t in enumerate(self.tables):   # replacing a parameter keeps its place: tables come first
                t.weight = nn.Parameter(_whole_table(seed, i, rows, dim).to(device))

    def initial_rows(self, table: int, start: int = 0, step: int = 1) -> Iterator[torch.Tensor]:
        """Initial values of rows start, start + step, ... of table `table` (`table_rows`), for a process that
        builds only some rows of the tables."""
        t = self.tables[table]
        assert isinstance(t, nn.EmbeddingBag)
        return table_rows(self.seed, table, t.num_embeddings, t.embedding_dim, start, step)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 3 or ids.shape[1] != len(self.tables):
            raise ValueError(f"ids of shape {tuple(ids.shape)}: expected (batch, {len(self.tables)} tables, bag)")
        x = self.blocks[0](dense)
        vectors = [x] + [table(ids[:, i]) for i, table in enumerate(self.tables)]
        if self.interaction == "dot":
            z = torch.stack(vectors, 1)                        # (batch, n, dim)
            i, j = torch.tril_indices(z.shape[1], z.shape[1], offset=-1, device=z.device)  # each pair once
            features = torch.cat([x, torch.bmm(z, z.transpose(1, 2))[:, i, j]], 1)
        else:
            features = torch.cat(vectors, 1)
        return self.blocks[1](features).squeeze(-1)


def click_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean binary cross-entropy of the click logits against the 0/1 clicks."""
    dense, ids, clicks = batch
    return F.binary_cross_entropy_with_logits(model(dense, ids).float(), clicks.float())
