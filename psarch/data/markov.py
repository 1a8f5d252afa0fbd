"""Synthetic tokens from a random sparse Markov chain with an exactly known entropy rate.

Sequences start from the stationary distribution, so every next-token prediction has the same best
achievable cross-entropy: the chain's entropy rate H = -sum_s pi(s) sum_t P(s,t) log P(s,t), in nats.
"""
from __future__ import annotations

import numpy as np
import torch


class MarkovSource:
    """A chain over `vocab_size` states, each with `branching` successors (one is s+1, so it is irreducible)."""

    def __init__(self, vocab_size: int, branching: int, seed: int, concentration: float = 1.0) -> None:
        if branching > vocab_size:
            raise ValueError(f"branching = {branching} exceeds vocab_size = {vocab_size}")
        rng = np.random.default_rng(seed + 0x5EED)
        succ = np.empty((vocab_size, branching), dtype=np.int64)
        for s in range(vocab_size):
            others = rng.choice(np.delete(np.arange(vocab_size), (s + 1) % vocab_size), branching - 1, replace=False)
            succ[s] = np.concatenate([[(s + 1) % vocab_size], others])
        probs = rng.dirichlet(np.full(branching, concentration), size=vocab_size)
        probs = np.maximum(probs, 1e-3)  # every listed edge stays reachable
        probs /= probs.sum(1, keepdims=True)
        self.vocab_size = vocab_size
        self.successors = torch.from_numpy(succ)
        self.probs = torch.from_numpy(probs)
        self.cum = torch.cumsum(self.probs, 1)
        self.stationary = torch.from_numpy(self._stationary(succ, probs))
        row_h = -(probs * np.log(probs)).sum(1)
        self.entropy_rate = float((self.stationary.numpy() * row_h).sum())

    @staticmethod
    def _stationary(succ: np.ndarray, probs: np.ndarray) -> np.ndarray:
        v = succ.shape[0]
        p = np.zeros((v, v))
        np.add.at(p, (np.repeat(np.arange(v), succ.shape[1]), succ.ravel()), probs.ravel())
        a = np.vstack([p.T - np.eye(v), np.ones((1, v))])
        b = np.zeros(v + 1)
        b[-1] = 1.0
        pi = np.linalg.lstsq(a, b, rcond=None)[0]
        return np.clip(pi, 0, None) / np.clip(pi, 0, None).sum()

    def sample(self, rows: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """`rows` sequences of `length` tokens, int64."""
        out = torch.empty(rows, length, dtype=torch.int64)
        out[:, 0] = torch.multinomial(self.stationary.float(), rows, replacement=True, generator=gen)
        u = torch.rand(length - 1, rows, 1, generator=gen, dtype=torch.float64)
        for t in range(1, length):
            cur = out[:, t - 1]
            k = torch.searchsorted(self.cum[cur], u[t - 1]).clamp_(max=self.successors.shape[1] - 1)
            out[:, t] = self.successors[cur].gather(1, k).squeeze(1)
        return out
