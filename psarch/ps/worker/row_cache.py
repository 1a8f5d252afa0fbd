"""A GEO worker's embedding rows between two syncs (PaddlePaddle's GEO-SGD on a sparse table).

The cache holds the rows the worker has read since its last sync: their values, trained locally by a
row-wise optimizer (psarch/ps/row_optim.py, state for the cached rows only), and their values as last pulled. A
step pulls only the rows it reads that are not cached yet; a sync pushes (value − pulled) / N of the rows
that changed, then empties the cache, so the next steps pull the servers' new values. The worker holds at
most the rows its last k_steps batches read, never a whole table. The local optimizer's state goes with the
cache: every window starts its rows afresh (Adagrad's sums at initial_accumulator_value, AdamW's moments and
step counts at 0), unlike the dense part's local optimizer, which keeps its state from window to window.
"""
from __future__ import annotations

import torch

from psarch.config import TrainConfig
from psarch.ps.row_optim import RowOptimizer


class RowCache:
    """Rows keyed by their global keys (psarch/ps/rows.py), in order of arrival."""

    def __init__(self, dim: int, t: TrainConfig) -> None:
        self.dim, self.t = dim, t
        self.clear()

    def clear(self) -> None:
        self.keys = torch.empty(0, dtype=torch.int64)
        self.synced = torch.empty(0, self.dim)
        self.optim = RowOptimizer(torch.empty(0, self.dim), self.t)

    @property
    def rows(self) -> torch.Tensor:
        return self.optim.table

    def missing(self, keys: torch.Tensor) -> torch.Tensor:
        """The keys (sorted) that are not cached."""
        return keys[~torch.isin(keys, self.keys)]

    def add(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Cache freshly pulled rows."""
        self.keys = torch.cat([self.keys, keys])
        self.synced = torch.cat([self.synced, rows.float()])
        self.optim.extend(rows)

    def positions(self, keys: torch.Tensor) -> torch.Tensor:
        """Where the (cached) keys are in the cache."""
        order = torch.argsort(self.keys)
        return order[torch.searchsorted(self.keys[order], keys)]

    def deltas(self, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted keys, (value − pulled) / workers) of the rows that changed since they were pulled."""
        order = torch.argsort(self.keys)
        delta = (self.rows[order] - self.synced[order]) / workers
        changed = (delta != 0).any(1)
        return self.keys[order][changed], delta[changed]

    def nbytes(self) -> int:
        """Bytes held: keys, values, pulled copies and optimizer state."""
        return 8 * self.keys.numel() + 4 * (self.rows.numel() + self.synced.numel()) + self.optim.state_bytes()
