"""A PS worker whose embedding tables stay on the servers (`backend.embeddings = "rows"`).

The worker holds the dense parameters (flat, pushed and pulled as by PSTrainer) and, per step, only the
rows its batch reads: for each table the distinct ids of the batch (u_t of them), pulled from their
servers as one compact (u_t, dim) table; the batch's ids are remapped to positions in it, forward and
backward run on it, and the rows' gradients are pushed back with their keys (psarch/ps/rows.py). A step
sends, per worker: rowpull (8·u bytes of keys) and rowpush (8·u of keys + u·dim·b of gradients), and
receives u·dim·b of rows, beside the dense push and pull (psarch.theory.ps_rows_traffic). GEO keeps the
rows it reads between syncs in a RowCache (row_cache.py) and pushes their deltas with the dense delta.

A worker never holds the full tables: the workload builds its model with the tables on the meta device
(psarch/workload.py), and rank 0's model.pt at the end is the servers' rows, not a copy of its own.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from psarch.checkpoint import Checkpoint, Pieces
from psarch.config import Config
from psarch.dist import DistContext
from psarch.errors import check_loss
from psarch.ps.client import Request
from psarch.ps.row_cache import RowCache
from psarch.ps.row_snapshot import cache_pieces, restore_cache
from psarch.ps.rows import gather_shards, join_model, key_space
from psarch.ps.snapshot import exact_records
from psarch.ps.trainer import PSTrainer
from psarch.embeddings import batch_ids, embedding_tables
from psarch.theory import expected_unique_ids
from psarch.trainer import MemoryReport, StepStats
from psarch.workload import Workload


class RowPSTrainer(PSTrainer):
    """A PS worker that pulls and pushes only the embedding rows each step touches."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        self.space = key_space(cfg)
        # what a checkpoint holds: the whole model, tables included, in its order
        full = {n: tuple(p.shape) for n, p in workload.model.named_parameters() if p.requires_grad}
        self.table_names = [name for name, _ in embedding_tables(workload.model)]
        self.tables = [t for _, t in embedding_tables(workload.model)]
        for t in self.tables:   # an empty, frozen placeholder: the flat vector holds the dense part only
            t.weight = nn.Parameter(torch.empty(0, self.space.dim), requires_grad=False)
        self.geo_pushes: list[Request] | None = None   # a GEO sync's row deltas, sent before its dense push
        self.row_counts: dict[str, int] = {}
        self.cache_peak = (0, 0, 0, 0)    # GEO: the largest cache's (rows, params, optimizer, buffers bytes)
        super().__init__(workload, cfg, ctx)
        self.param_shapes = full
        self.offsets = self.space.offsets()
        self.step_rows = 0                 # GEO: bytes of the last step's rows' gradients
        self.held = self.held_peak = 0     # bytes of embedding rows (and their gradients) held now / at most
        self.cache = RowCache(self.space.dim, cfg.train) if self.mode == "geo" else None

    def _keys(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(the batch's distinct keys, sorted; ids remapped to rows of the compact tables; u_t per table)."""
        local = torch.empty_like(ids)
        keys = []
        for t, rows in enumerate(self.space.rows):
            uniq, inverse = torch.unique(ids[:, t], return_inverse=True)
            if uniq[0] < 0 or uniq[-1] >= rows:
                raise ValueError(f"table {t}: ids from {int(uniq[0])} to {int(uniq[-1])}, the table has {rows} rows")
            local[:, t] = inverse
            keys.append(uniq + self.offsets[t])
        return torch.cat(keys), local, [k.numel() for k in keys]

    def _pull_rows(self, keys: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The rows of `keys` from their servers, in the order of `keys`; and each server's positions."""
        where = self.space.split(keys)
        # each reply lands in a table of as many rows as keys asked: a server answering other rows is refused
        reqs = [[Request({"op": "rowpull", "step": self.steps, "want": self.wire_dtype}, keys[pos],
                         into=torch.empty(pos.numel(), self.space.dim, dtype=self.dtype))] for pos in where]
        self.client.exchange(reqs)
        rows = torch.empty(keys.numel(), self.space.dim, dtype=self.dtype)
        for pos, (r,) in zip(where, reqs):
            rows[pos] = r.into
        return rows.to(self.ctx.device), where

    def _cached_rows(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GEO: the rows of `keys` from the cache, pulling the ones not cached yet; and their positions."""
        new = self.cache.missing(keys)
        self.row_counts["rows_pulled"] = new.numel()
        if new.numel():
            self.cache.add(new, self._pull_rows(new)[0].cpu())
        pos = self.cache.positions(keys)
        return self.cache.rows[pos].to(self.ctx.device, self.dtype), pos

    def step(self, batch: Any) -> StepStats:
        t_start = time.time()
        dense, ids, clicks = batch
        keys, local, sizes = self._keys(batch_ids(batch).cpu())
        t0 = time.perf_counter()
        rows, where = self._pull_rows(keys) if self.cache is None else self._cached_rows(keys)
        pulled_s = time.perf_counter() - t0
        weights = [nn.Parameter(r) for r in rows.split(sizes)]
        for table, w in zip(self.tables, weights):
            table.weight = w
        self.flat.zero_grad()
        loss = self.loss_fn(self.model, (dense, local.to(ids.device), clicks))
        check_loss(self.steps, self.ctx.rank, float(loss.detach()))
        loss.backward()
        grads = torch.cat([w.grad for w in weights]).cpu()
        if self.cache is not None:
            self.step_rows = grads.numel() * grads.element_size()
            info = self._geo_local_step(where, grads)
        else:
            pushes = [Request({"op": "rowpush", "step": self.steps, "version": self.versions[i]}, grads[pos],
                              keys=keys[pos]) for i, pos in enumerate(where)]
            self.steps += 1
            info = self._exchange(self.flat.grad, self.steps, {}, before=pushes)
            self._hold(2 * rows.numel() * rows.element_size())
        info["comm_s"] += pulled_s
        stats = self._stats(loss, info, t_start)
        stats.extra["unique_ids"] = int(keys.numel())
        stats.extra.update(self.row_counts)   # GEO: rows pulled this step (not cached), rows pushed at a sync
        self.row_counts = {}
        return stats

    def _hold(self, nbytes: int) -> None:
        self.held = nbytes
        self.held_peak = max(self.held_peak, nbytes)

    def _geo_local_step(self, pos: torch.Tensor, grads: torch.Tensor) -> dict[str, Any]:
        """GEO: a local optimizer step on the dense part and on the cached rows; a sync every k_steps."""
        self.local.step([self.flat.grad])
        self.cache.optim.step(pos, grads.float())
        self._hold(self.cache.nbytes())
        self.steps += 1
        info: dict[str, Any] = {"comm_s": 0.0, "skipped": False}
        if self.steps % self.cfg.backend.k_steps == 0:
            info.update(self._geo_round())
        return info

    def _geo_round(self) -> dict[str, Any]:
        """Push the changed rows' deltas (before the dense delta, on each connection), then empty the cache."""
        c = self.cache
        if c.keys.numel() >= self.cache_peak[0]:   # memory(): the cache at its largest, just before a sync
            self.cache_peak = (c.keys.numel(), 4 * c.rows.numel(), c.optim.state_bytes(), 4 * c.synced.numel() + 8 * c.keys.numel())
        keys, deltas = self.cache.deltas(self.n)
        self.row_counts["rows_pushed"] = keys.numel()
        self.geo_pushes = [Request({"op": "rowpush", "step": self.rounds, "version": self.versions[i]},
                                   deltas[pos].to(self.dtype), keys=keys[pos])
                           for i, pos in enumerate(self.space.split(keys))]
        try:
            return super()._geo_round()
        finally:
            self.geo_pushes = None
            self.cache.clear()

    def _exchange(self, pushed: torch.Tensor | None, step: int, header: dict[str, Any],
                  before: list[Request] | None = None) -> dict[str, Any]:
        return super()._exchange(pushed, step, header, before if before is not None else self.geo_pushes)

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """The dense worker's part; GEO: and its RowCache (psarch/ps/row_snapshot.py)."""
        pieces = super().checkpoint_pieces(writing)
        return cache_pieces(self, pieces) if self.cache is not None else pieces

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        """As a dense worker; GEO: the RowCache exactly where the checkpoint is this run's (a fork starts empty)."""
        super().load_checkpoint(ckpt)
        ps = exact_records(ckpt, self.cfg)
        record = next((r for r in ps["workers"] if r["rank"] == self.ctx.rank), None) if ps is not None else None
        if self.cache is not None and record is not None:
            restore_cache(self, ckpt, record)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0: the servers' dense ranges and rows, as the model's state_dict. Every rank then tells
        the servers it is done."""
        if self.cache is not None and self.steps % self.cfg.backend.k_steps:
            self._geo_round()
        state: dict[str, torch.Tensor] = {}
        if self.ctx.rank == 0:
            dense = torch.empty(self.flat.numel, dtype=torch.float32)
            reqs = [[Request({"op": "fetch"}, into=dense[lo:hi]), Request({"op": "rowfetch"})] for lo, hi in self.ranges]
            self.client.exchange(reqs)
            state = join_model(self.model, self.space, dense, gather_shards(self.space, [r[1].into for r in reqs]))
        self.client.exchange([[Request({"op": "done"})] for _ in self.ranges])
        return state

    def memory(self) -> MemoryReport:
        m = super().memory()
        if self.cache is not None:   # GEO: the largest cache (rows, optimizer state, pulled copies and keys)
            _, params, optimizer, buffers = self.cache_peak
            m.params, m.optimizer, m.buffers = m.params + params, m.optimizer + optimizer, m.buffers + buffers
            m.grads += self.step_rows   # the last step's rows' gradients
        else:                        # the last step's rows, and as much again for their gradients
            m.params += self.held // 2
            m.grads += self.held // 2
        return m

    def summary_extra(self) -> dict[str, Any]:
        # E[u] per step beside each step's measured `unique_ids` (metrics.jsonl)
        return dict(super().summary_extra(), embedding_bytes_held_peak=self.held_peak,
                    embedding_table_bytes=self.space.total * self.space.dim * 4,
                    unique_ids_expected=expected_unique_ids(self.cfg))
