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
            # branching-1 other states, never s+1: draw indices into the v-1 states other than s+1 and skip
            # over s+1. The same draws (so the same chain) as choosing from that array, in O(branching).
            nxt = (s + 1) % vocab_size
            others = rng.choice(vocab_size - 1, branching - 1, replace=False)
            succ[s, 0] = nxt
            succ[s, 1:] = others + (others >= nxt)
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
    def _stationary(succ: np.ndarray, probs: np.ndarray, tol: float = 1e-14, max_iter: int = 10**6) -> np.ndarray:
        """pi = pi P by power iteration on the sparse successor table: O(v * branching) a step, where a dense
        v x v solve needs O(v^2) memory and O(v^3) time. The chain iterated is the lazy one, (I + P) / 2: it
        has the same stationary distribution and is aperiodic, so the iteration converges even when P is
        periodic (branching = 1 is a cycle). It stops when a step moves pi by < 1e-14 (L1); the distance left
        to the fixed point is about that step divided by the chain's spectral gap, so slow-mixing chains
        (tiny concentration) need more iterations and are less exact: the tests check the entropy rate
        against a dense solve to 1e-10 on chains of that kind, not a bound for every chain."""
        v = succ.shape[0]
        flat = succ.ravel()
        pi = np.full(v, 1.0 / v)
        for _ in range(max_iter):
            nxt = 0.5 * (pi + np.bincount(flat, weights=(pi[:, None] * probs).ravel(), minlength=v))
            done = np.abs(nxt - pi).sum() < tol
            pi = nxt
            if done:
                return pi / pi.sum()
        raise RuntimeError(f"Markov chain of {v} states: stationary distribution did not converge "
                           f"in {max_iter} iterations")

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
