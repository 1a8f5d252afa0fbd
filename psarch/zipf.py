"""The Zipf law of the clicks source's ids, as arithmetic (numpy only): the probabilities by rank, and how
many distinct ids a number of draws touches, which the theory of every sparse backend predicts from."""
from __future__ import annotations

import numpy as np


def zipf_probs(rows: int, exponent: float) -> np.ndarray:
    """P(rank k) for k = 0 .. rows-1, ∝ (k+1)^-exponent (0 is uniform), float64, summing to 1."""
    w = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
    return w / w.sum()


def expected_unique(rows: int, exponent: float, draws: int) -> float:
    """Expected number of distinct ids among `draws` independent Zipf draws from one table:
    Σ_k 1 − (1 − p_k)^draws (each id counts once if drawn at least once)."""
    p = zipf_probs(rows, exponent)
    return float(np.sum(-np.expm1(draws * np.log1p(-np.minimum(p, 1.0 - 1e-16)))))
