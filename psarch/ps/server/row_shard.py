"""One server's shard of the embedding tables (`backend.embeddings = "rows"`): the rows it owns (keys k with
k mod servers = its index, psarch/ps/rows.py), their row-wise optimizer (psarch/ps/row_optim.py) and, in the
barrier modes, the rows pushed in the current round (summed over workers, then applied once)."""
from __future__ import annotations

import torch

from psarch.config import Config
from psarch.models.dlrm import table_rows
from psarch.ps.errors import PSError
from psarch.ps.row_optim import RowOptimizer
from psarch.ps.rows import KeySpace
from psarch.ps.server.updates import NonFiniteUpdate


def initial_shard(cfg: Config, space: KeySpace, index: int) -> torch.Tensor:
    """Server `index`'s rows of the initial tables (keys k mod servers = index, in key order), computed a
    block of rows at a time: the server never holds the whole tables."""
    out, pos = torch.empty(space.owned(index), space.dim), 0
    for t, (lo, n) in enumerate(zip(space.offsets(), space.rows)):
        # table t's ids i with (lo + i) mod servers = index
        for chunk in table_rows(cfg.seed, t, n, space.dim, (index - lo) % space.servers, space.servers):
            out[pos:pos + chunk.shape[0]] = chunk
            pos += chunk.shape[0]
    return out


class RowShard:
    """Server `index`'s rows of every table (fp32), their optimizer, and a round's pushed rows."""

    def __init__(self, rows: torch.Tensor, space: KeySpace, index: int, cfg: Config) -> None:
        """rows: this server's rows of the initial tables, (space.owned(index), dim) (`initial_shard`); the
        shard owns them and updates them in place (no copy: a shard may be most of a server's memory)."""
        if tuple(rows.shape) != (space.owned(index), space.dim):
            raise ValueError(f"server {index}'s rows of shape {tuple(rows.shape)}: expected "
                             f"({space.owned(index)}, {space.dim})")
        self.space, self.index = space, index
        self.rows = rows.float()
        self.geo = cfg.backend.mode == "geo"
        self.optim = None if self.geo else RowOptimizer(self.rows, cfg.train)
        self.round_idx: list[torch.Tensor] = []     # barrier modes: local rows pushed this round ...
        self.round_values: list[torch.Tensor] = []  # ... and their gradients (deltas), per push
        self.round_from: list[int] = []             # ... and the worker of each push

    def local(self, keys: torch.Tensor, op: str) -> torch.Tensor:
        """Local row indices of `keys`; PSError unless they are int64, 1-D, strictly increasing (no
        duplicates) and all owned by this server."""
        if keys.dtype != torch.int64 or keys.dim() != 1:
            raise PSError(f"{op}: keys of dtype {keys.dtype} and shape {list(keys.shape)}: expected int64 of one dimension")
        s, n = self.space.servers, keys.numel()
        if n and (keys[0] < 0 or keys[-1] >= self.space.total):
            raise PSError(f"{op}: keys from {int(keys[0])} to {int(keys[-1])}: every key must be in "
                          f"[0, {self.space.total}) (the rows of all tables)")
        if n > 1 and not bool((keys[1:] > keys[:-1]).all()):
            raise PSError(f"{op}: keys must be strictly increasing (sorted, no duplicates)")
        if n and not bool((keys % s == self.index).all()):
            bad = int(keys[keys % s != self.index][0])
            raise PSError(f"{op}: key {bad} belongs to server {bad % s}, this is server {self.index} "
                          f"(keys k with k mod {s} = {self.index})")
        return keys // s

    def gather(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.rows[idx].to(dtype)

    def apply(self, idx: torch.Tensor, values: torch.Tensor, factor: float = 1.0) -> None:
        """async / ssp: one row-wise optimizer step; geo: add the deltas (times `factor`). NonFiniteUpdate, and
        nothing changes, when a row or its optimizer state would not be finite."""
        self.write(idx, self.update(idx, values, factor))

    def update(self, idx: torch.Tensor, values: torch.Tensor, factor: float = 1.0) -> dict[str, torch.Tensor]:
        """What `apply` would store (rows idx's new values, "param", and their optimizer state), checked finite."""
        if self.optim is None:   # geo; idx are distinct: as index_add_ adds them
            new = {"param": self.rows[idx].add_(values.float(), alpha=factor)}
        else:
            new = self.optim.update(idx, values.float())
        if not all(bool(torch.isfinite(v).all()) for v in new.values() if v.is_floating_point()):
            raise NonFiniteUpdate("its update would make rows or their optimizer state non-finite")
        return new

    def write(self, idx: torch.Tensor, new: dict[str, torch.Tensor]) -> None:
        if self.optim is None:   # geo
            self.rows[idx] = new["param"]
        else:
            self.optim.write(idx, new)

    def add_to_round(self, worker: int, idx: torch.Tensor, values: torch.Tensor) -> None:
        """sync / geo with barrier: keep one worker's rows of this round."""
        self.round_idx.append(idx)
        self.round_values.append(values.float())
        self.round_from.append(worker)

    def drop(self, worker: int) -> None:
        """Forget a worker's rows of this round (it was lost before its dense push joined the round)."""
        keep = [i for i, w in enumerate(self.round_from) if w != worker]
        self.round_idx = [self.round_idx[i] for i in keep]
        self.round_values = [self.round_values[i] for i in keep]
        self.round_from = [self.round_from[i] for i in keep]

    def round_update(self, factor: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """The round's rows summed over workers, times `factor` (sync: 1/N, the mean gradient), as the update
        `write` stores (None: no rows this round); NonFiniteUpdate as `update`. The sum goes in worker order, not
        arrival order (index_add_ on CPU adds in source order), so that its bits do not depend on timing."""
        if not self.round_idx:
            return None
        order = sorted(range(len(self.round_from)), key=self.round_from.__getitem__)
        idx, inverse = torch.unique(torch.cat([self.round_idx[i] for i in order]), return_inverse=True)
        values = torch.cat([self.round_values[i] for i in order])
        total = torch.zeros(idx.numel(), self.space.dim).index_add_(0, inverse, values)
        return idx, self.update(idx, total.mul_(factor))

    def apply_round(self, factor: float) -> None:
        """`round_update`, then `end_round`."""
        self.end_round(self.round_update(factor))

    def end_round(self, update: tuple[torch.Tensor, dict[str, torch.Tensor]] | None) -> None:
        """Store the round's update (`round_update`'s) and forget the round's rows."""
        if update is not None:
            self.write(*update)
        self.round_idx, self.round_values, self.round_from = [], [], []

    def memory(self) -> dict[str, int]:
        """Bytes this shard holds, by category."""
        params = self.rows.numel() * 4
        optim = self.optim.state_bytes() if self.optim is not None else 0
        buffers = sum(t.numel() * t.element_size() for t in self.round_idx + self.round_values)
        return {"params": params, "optimizer": optim, "buffers": buffers}
