"""Synthetic click-through data whose best achievable loss is known.

A sample has `dense` Gaussian features x and, for each of `num_tables` sparse features, a bag of `bag` ids
drawn from a Zipf law over `rows` ids (P(rank k) ∝ k^-zipf; 0 is uniform). Which id holds which rank is a
seeded permutation per table, so the hot ids are scattered over the table, as in real logs. The label is
a click drawn from a hidden logistic model, the "true" model:

    z = TRUE_BIAS + v·x + Σ_t mean_{i in bag t} w_t[i],    click ~ Bernoulli(sigmoid(z))

No model does better in expectation than the true probabilities, so the best achievable binary
cross-entropy is the conditional entropy E[h(sigmoid(z))], h(p) = -p log p - (1-p) log(1-p): the
workload's entropy floor. v·x is N(0, DENSE_STD²) whatever v is, so its expectation is taken exactly by
Gauss-Hermite quadrature; the sparse sum has no closed form and is averaged over a fixed Monte-Carlo
sample of FLOOR_SAMPLES draws, whose standard error is kept in `floor_stderr` (~4e-4 nats at 4 tables).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from psarch.data import clicks_hidden
from psarch.zipf import zipf_probs
from psarch.data.clicks_hidden import DENSE_STD

TRUE_BIAS = -1.0      # a click rate of about 0.3: imbalanced labels, as CTR data has
FLOOR_SAMPLES = 2**18
GH_NODES = 16         # h(sigmoid(.)) is analytic and DENSE_STD small: 16 nodes integrate it to ~1e-12


class ZipfSampler:
    """Ids in [0, rows) per table: rank k (0-based) has probability ∝ (k+1)^-exponent and is id perm[t, k]."""

    def __init__(self, rows: int, exponent: float, perm: torch.Tensor) -> None:
        if perm.dim() != 2 or perm.shape[1] != rows:
            raise ValueError(f"perm of shape {tuple(perm.shape)}: expected (tables, {rows})")
        self.probs = zipf_probs(rows, exponent)   # by rank
        cdf = np.cumsum(self.probs)
        cdf[-1] = 1.0                         # rounding must not leave a gap above the last rank
        self.cdf = torch.from_numpy(cdf)
        self.perm = perm

    def sample(self, n: int, bag: int, gen: torch.Generator) -> torch.Tensor:
        """Ids of shape (n, tables, bag), int64: inverse-CDF sampling, one uniform draw per id."""
        tables = self.perm.shape[0]
        u = torch.rand(n, tables, bag, generator=gen, dtype=torch.float64)
        ranks = torch.searchsorted(self.cdf, u.reshape(-1), right=True).clamp_(max=self.cdf.numel() - 1)
        ranks = ranks.reshape(n, tables, bag)
        return self.perm[torch.arange(tables).view(1, tables, 1), ranks]


_FLOORS: dict[tuple, tuple[float, float]] = {}   # (entropy rate, its standard error) by ClickSource's arguments
FLOOR_FILE = "floor.json"   # the floor the launcher shares beside the hidden model (clicks_hidden.ENV)


def share_floor(num_tables: int, rows: int, bag: int, dense: int, zipf: float, seed: int) -> None:
    """Write this source's floor into the folder the launcher shares its hidden model in (within
    clicks_hidden.shared), so that its ranks read it instead of each computing it."""
    key = (num_tables, rows, bag, dense, zipf, seed)
    path = Path(os.environ[clicks_hidden.ENV]) / FLOOR_FILE
    path.unlink(missing_ok=True)   # an earlier run's, left by a crash: never passed on, computed (or kept) here
    source = ClickSource(*key)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "floor": [source.entropy_rate, source.floor_stderr]}))
    os.replace(tmp, path)   # whole or absent


def _shared_floor(key: tuple) -> tuple[float, float] | None:
    """The floor of this source where the launcher shared it (share_floor), else None."""
    folder = os.environ.get(clicks_hidden.ENV)
    try:
        shared = json.loads((Path(folder) / FLOOR_FILE).read_text()) if folder else None
        return (float(shared["floor"][0]), float(shared["floor"][1])) if shared and shared["key"] == list(key) else None
    except (OSError, ValueError, KeyError, TypeError, IndexError):   # absent, or not one this module wrote
        return None


class ClickSource:
    """Samples (dense features, ids, clicks) and knows the true model behind the clicks."""

    def __init__(self, num_tables: int, rows: int, bag: int, dense: int, zipf: float, seed: int) -> None:
        for name, value in (("num_tables", num_tables), ("rows", rows), ("bag", bag), ("dense", dense)):
            if value < 1:
                raise ValueError(f"{name} = {value}: must be >= 1")
        if zipf < 0:
            raise ValueError(f"zipf = {zipf}: must be >= 0 (0 is uniform)")
        self.num_tables, self.rows, self.bag, self.dense = num_tables, rows, bag, dense
        hidden = clicks_hidden.load(num_tables, rows, dense, seed)   # mapped when the launcher shares it
        self.sampler = ZipfSampler(rows, zipf, hidden.perm)
        self.row_weights, self.dense_weights = hidden.row_weights, hidden.dense_weights
        self.bias = TRUE_BIAS
        key = (num_tables, rows, bag, dense, zipf, seed)   # all the hidden model and the sampler depend on
        if key not in _FLOORS:   # a quarter of a CPU-s: once a process (a test's, a sweep's runs build it often)
            _FLOORS[key] = _shared_floor(key) or self._floor(torch.Generator().manual_seed(seed + 0xF100))
        self.entropy_rate, self.floor_stderr = _FLOORS[key]

    def sparse_term(self, ids: torch.Tensor) -> torch.Tensor:
        """Σ_t mean over the bag of w_t[id], float64, for ids of shape (n, tables, bag)."""
        t = torch.arange(self.num_tables).view(1, -1, 1)
        return self.row_weights[t, ids].mean(-1).sum(-1)

    def true_logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The hidden model's click logit z, float64."""
        return self.bias + dense.double() @ self.dense_weights + self.sparse_term(ids)

    def sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dense float32 (n, dense), ids int64 (n, tables, bag), clicks float32 (n,) of 0/1)."""
        dense = torch.randn(n, self.dense, generator=gen)
        ids = self.sampler.sample(n, self.bag, gen)
        p = torch.sigmoid(self.true_logits(dense, ids))
        clicks = (torch.rand(n, generator=gen, dtype=torch.float64) < p).float()
        return dense, ids, clicks

    def expected_entropy(self, sparse: torch.Tensor) -> np.ndarray:
        """E over the dense term of h(sigmoid(z)) given each sparse sum: Gauss-Hermite quadrature."""
        nodes, weights = np.polynomial.hermite_e.hermegauss(GH_NODES)  # weight exp(-x²/2)
        weights = weights / weights.sum()
        s = sparse.numpy() + self.bias
        out = np.zeros_like(s)
        for x, w in zip(nodes, weights):  # a loop over nodes keeps memory at one vector
            z = s + DENSE_STD * x
            # h(sigmoid(z)) = p softplus(-z) + (1-p) softplus(z) = softplus(z) - p z
            out += w * (np.logaddexp(0.0, z) - z / (1.0 + np.exp(-z)))
        return out

    def _floor(self, gen: torch.Generator) -> tuple[float, float]:
        g = self.expected_entropy(self.sparse_term(self.sampler.sample(FLOOR_SAMPLES, self.bag, gen)))
        return float(g.mean()), float(g.std(ddof=1) / np.sqrt(g.size))
