"""DLRM (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and Recommendation
Systems"): one embedding bag per sparse feature, a bottom MLP over the dense features, a pairwise-dot or
concat interaction of the resulting vectors, and a top MLP to one click logit, trained with binary
cross-entropy.

Two choices differ from the reference code, so that the hidden model of `clicks` data (a logistic
model: bias + linear dense term + one weight per row) is exactly representable with interaction "cat"
and no hidden layers: the bottom MLP's output layer has no ReLU, and bags are mean-pooled (the logit's
scale does not grow with the bag size).
"""
from __future__ import annotations

from typing import Sequence

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


class DLRM(nn.Module):
    """Click logit from dense features (batch, num_dense) and ids (batch, num_tables, bag)."""

    def __init__(self, num_dense: int, num_tables: int, rows: int, dim: int, bottom_mlp: Sequence[int] = (64,),
                 top_mlp: Sequence[int] = (64,), interaction: str = "dot") -> None:
        super().__init__()
        if interaction not in ("dot", "cat"):
            raise ValueError(f"interaction = {interaction!r}: allowed values are \"dot\", \"cat\"")
        self.interaction = interaction
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="mean") for _ in range(num_tables))
        for t in self.tables:  # the reference code's init: U(-sqrt(1/rows), sqrt(1/rows))
            nn.init.uniform_(t.weight, -rows ** -0.5, rows ** -0.5)
        n = num_tables + 1  # the bottom MLP's output is one more vector beside the embeddings
        top_in = dim + n * (n - 1) // 2 if interaction == "dot" else n * dim
        # ZeRO's units, in forward order; the tables form the root unit
        self.blocks = nn.ModuleList([_mlp([num_dense, *bottom_mlp, dim]), _mlp([top_in, *top_mlp, 1])])

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
