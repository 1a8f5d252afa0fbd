"""A PS worker's embedding rows when its tables stay on the servers (`backend.embeddings = "rows"`): the
treatment (psarch.embeddings.EmbeddingTables, with the PS's own part in tables.py) the worker holds.

The worker holds the dense parameters (flat, pushed and pulled as without rows) and, per step, only the rows
its batch reads: for each table the distinct ids of the batch (u_t of them), pulled from their servers as one
compact (u_t, dim) table; the batch's ids are remapped to positions in it, forward and backward run on it,
and the rows' gradients are pushed back with their keys (psarch/ps/rows.py) before the dense push, on the
same connections. A step sends, per worker: rowpull (8·u bytes of keys) and rowpush (8·u of keys + u·dim·b of
gradients), and receives u·dim·b of rows, beside the dense push and pull (psarch/ps/theory.py's
rows_traffic). GEO keeps the rows it reads between syncs in a RowCache (row_cache.py) and pushes their
deltas with the dense delta.

A worker never holds the full tables: the workload builds its model with the tables on the meta device
(psarch/workload.py), and rank 0's model.pt at the end is the servers' rows, not a copy of its own.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import Fragment
from psarch.config import Config
from psarch.embeddings import batch_ids, embedding_tables
from psarch.ps import wire
from psarch.ps.row_snapshot import cache_fragments
from psarch.ps.rows import gather_shards, key_space
from psarch.ps.snapshot import RowsRecord, WorkerRecord
from psarch.ps.worker.client import PSClient, Request
from psarch.ps.worker.row_cache import RowCache
from psarch.ps.worker.tables import PSTables
from psarch.theory import expected_unique_ids, table_params


class WorkerRows(PSTables):
    """The rows of a worker's step (the "rows" treatment on a PS worker: tables.py): `fetch` them before forward,
    `exchange` takes their gradients after backward and `before_push` sends them ahead of the dense push (GEO:
    `step` applies them to the cache, and `before_push` sends the cache's deltas at a sync); its part of a
    checkpoint, its memory, its figures."""

    name = "rows"

    def __init__(self, model: nn.Module, cfg: Config, client: PSClient, dtype: torch.dtype,
                 device: torch.device, rank: int) -> None:
        """Takes the tables out of `model` (empty, frozen placeholders): call before the model moves."""
        self.cfg, self.client, self.dtype, self.device, self.rank = cfg, client, dtype, device, rank
        self.wire_dtype = wire.DTYPE_NAMES[dtype]
        self.space = key_space(cfg)
        self.offsets = self.space.offsets()
        self.table_names = [name for name, _ in embedding_tables(model)]
        self.tables = [t for _, t in embedding_tables(model)]
        for t in self.tables:   # an empty, frozen placeholder: the flat vector holds the dense part only
            t.weight = nn.Parameter(torch.empty(0, self.space.dim), requires_grad=False)
        self.cache = RowCache(self.space.dim, cfg.train) if cfg.backend.mode == "geo" else None
        self.steps = 0   # the worker's steps taken (the step a rowpull is for)
        # this step's rows: their keys (sorted), each server's positions (GEO: positions in the cache), weights
        self.keys = torch.empty(0, dtype=torch.int64)
        self.where: Any = None
        self.weights: list[nn.Parameter] = []
        self.grads = torch.empty(0)         # sync, async, ssp: this step's rows' gradients, for before_push
        self.counts: dict[str, int] = {}    # GEO: rows pulled this step (not cached), rows pushed at a sync
        self.cache_peak = (0, 0, 0, 0)      # GEO: the largest cache's (rows, params, optimizer, buffers bytes)
        self.grad_bytes = 0                 # GEO: bytes of the last step's rows' gradients
        self.held = self.held_peak = 0      # bytes of embedding rows (and their gradients) held now / at most

    # ------------------------------------------------------------------ a step

    def fetch(self, batch: Any) -> Any:
        """Pull the rows `batch` reads into the model's tables; the batch with its ids remapped to rows of
        those tables."""
        dense, ids, clicks = batch
        keys, local, sizes = self._keys(batch_ids(batch).cpu())
        cache = self.cache
        rows, self.where = self._pull(keys, self.steps) if cache is None else self._cached(cache, keys, self.steps)
        self.steps += 1
        self.keys = keys
        self.weights = [nn.Parameter(r) for r in rows.split(sizes)]
        for table, w in zip(self.tables, self.weights):
            table.weight = w
        return dense, local.to(ids.device), clicks

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

    def _pull(self, keys: torch.Tensor, step: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The rows of `keys` from their servers, in the order of `keys`; and each server's positions."""
        where = self.space.split(keys)
        # each reply lands in a table of as many rows as keys asked: a server answering other rows is refused
        reqs = [[Request({"op": "rowpull", "step": step, "want": self.wire_dtype}, keys[pos],
                         into=torch.empty(pos.numel(), self.space.dim, dtype=self.dtype))] for pos in where]
        self.client.exchange(reqs)
        rows = torch.empty(keys.numel(), self.space.dim, dtype=self.dtype)
        for pos, (r,) in zip(where, reqs):
            rows[pos] = r.received
        return rows.to(self.device), where

    def _cached(self, cache: RowCache, keys: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """GEO: the rows of `keys` from the cache, pulling the ones not cached yet; and their positions."""
        new = cache.missing(keys)
        self.counts["rows_pulled"] = new.numel()
        if new.numel():
            cache.add(new, self._pull(new, step)[0].cpu())
        pos = cache.positions(keys)
        return cache.rows[pos].to(self.device, self.dtype), pos

    def _grads(self) -> torch.Tensor:
        grads = [w.grad for w in self.weights]
        if any(g is None for g in grads):
            raise RuntimeError("a table's fetched rows have no gradient after backward")
        return torch.cat([g for g in grads if g is not None]).cpu()

    def exchange(self, batch: Any, grads: list[torch.Tensor]) -> dict[str, int]:
        """After backward (GEO: after the step and its sync): take the rows' gradients for `before_push`; this
        step's figures for metrics.jsonl: distinct ids; GEO: rows pulled, rows pushed at a sync."""
        if self.cache is None:
            self.grads = self._grads()
            self._hold(2 * self.grads.numel() * self.grads.element_size())   # the rows, as much for gradients
        out = {"unique_ids": int(self.keys.numel()), **self.counts}
        self.counts = {}
        return out

    def step(self) -> bool:
        """GEO, after the dense part's local step: a row-wise optimizer step on the cached rows."""
        if self.cache is None:
            return False
        grads = self._grads()
        self.grad_bytes = grads.numel() * grads.element_size()
        self.cache.optim.step(self.where, grads.float())
        self._hold(self.cache.nbytes())
        return False

    def before_push(self, push: int, versions: list[int | None]) -> list[Request]:
        """Per server, the rowpush to go before dense push `push`: this step's rows' gradients; GEO, at a sync: the
        changed rows' deltas (value − pulled) / N (`pushed` empties the cache once the exchange is over)."""
        if self.cache is None:
            return [Request({"op": "rowpush", "step": push, "version": versions[i]}, self.grads[pos],
                            keys=self.keys[pos]) for i, pos in enumerate(self.where)]
        c = self.cache
        if c.keys.numel() >= self.cache_peak[0]:   # memory(): the cache at its largest, just before a sync
            self.cache_peak = (c.keys.numel(), 4 * c.rows.numel(), c.optim.state_bytes(),
                               4 * c.synced.numel() + 8 * c.keys.numel())
        keys, deltas = c.deltas(self.cfg.backend.world_size)
        self.counts["rows_pushed"] = keys.numel()
        return [Request({"op": "rowpush", "step": push, "version": versions[i]}, deltas[pos].to(self.dtype),
                        keys=keys[pos]) for i, pos in enumerate(self.space.split(keys))]

    def pushed(self) -> None:
        """GEO: the sync is over; the next steps pull the servers' new rows."""
        if self.cache is not None:
            self.cache.clear()

    def _hold(self, nbytes: int) -> None:
        self.held = nbytes
        self.held_peak = max(self.held_peak, nbytes)

    # ------------------------------------------------------------------ the model, checkpoints, figures

    def full_tables(self) -> dict[str, torch.Tensor]:
        """The whole fp32 tables by parameter name, fetched from their servers (`rowfetch`: each its shard)."""
        fetched = [[Request({"op": "rowfetch"})] for _ in range(self.space.servers)]
        self.client.exchange(fetched)
        rows = gather_shards(self.space, [r.received for (r,) in fetched])
        return {name: rows[lo:lo + n] for name, lo, n in zip(self.table_names, self.offsets, self.space.rows)}

    def fragments(self) -> list[Fragment]:
        """GEO: the worker's RowCache, its rows as fragments (their keys in `record`)."""
        return cache_fragments(self.cache, self.space, self.table_names, self.rank) if self.cache is not None else []

    def record(self) -> RowsRecord:
        return {"cache_keys": self.cache.keys.tolist()} if self.cache is not None else {}

    def restore(self, ckpt: Checkpoint, record: WorkerRecord | None) -> None:
        """From step K on; GEO, from this worker's own record: its RowCache as it wrote it (its keys in their
        order, rows, pulled copies, state); a fork starts with an empty cache."""
        self.steps = ckpt.step
        if self.cache is None or record is None:
            return
        c = self.cache
        c.clear()
        keys = torch.tensor(record["cache_keys"], dtype=torch.int64)
        c.add(keys, torch.zeros(keys.numel(), self.space.dim))
        with torch.no_grad():
            for f in self.fragments():   # views into the cache's tensors
                ckpt.fill(f)

    def memory(self) -> dict[str, int]:
        """Bytes of rows it holds, by MemoryReport category (added to the worker's)."""
        if self.cache is not None:   # GEO: the largest cache (rows, optimizer state, pulled copies and keys)
            _, params, optimizer, buffers = self.cache_peak
            return {"params": params, "optimizer": optimizer, "buffers": buffers,
                    "grads": self.grad_bytes}   # and the last step's rows' gradients
        # the last step's rows, and as much again for their gradients
        return {"params": self.held // 2, "grads": self.held // 2}

    def summary(self) -> dict[str, float]:
        """E[u] per step beside each step's measured `unique_ids` (metrics.jsonl); the bytes held at most."""
        return {"embedding_bytes_held_peak": self.held_peak, "embedding_table_bytes": table_params(self.cfg) * 4,
                "unique_ids_expected": expected_unique_ids(self.cfg)}
