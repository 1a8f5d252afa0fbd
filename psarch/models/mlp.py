"""An MLP next-token model: it sees only the current token, which is all a first-order Markov source needs."""
from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Embedding, `n_layer` hidden GELU layers, logits over the vocabulary."""

    def __init__(self, vocab_size: int, n_embd: int = 64, hidden: int = 256, n_layer: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, n_embd)
        layers: list[nn.Module] = []
        width = n_embd
        for _ in range(n_layer):
            layers.append(nn.Sequential(nn.Linear(width, hidden), nn.GELU()))
            width = hidden
        self.blocks = nn.ModuleList(layers)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
