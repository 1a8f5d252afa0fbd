"""Checkpoints of the embedding rows (`backend.embeddings = "rows"`), in psarch.checkpoint's format.

A row server writes (psarch/ps/server/rows.py), beside its dense range (psarch/ps/snapshot.py), its shard of
every table under the table's parameter name (`tables.<t>.weight`): the rows it owns (key mod S = its index)
are every S-th row of a table, one strided fragment per table (Fragment.row_stride), so the reader reassembles
any range of a table and consolidates it one parameter at a time. The row optimizer's state goes by the dense
optimizers' names: Adagrad's `sum`, AdamW's `exp_avg` / `exp_avg_sq`; lazy AdamW's per-row step counts,
which no dense optimizer has, under the private key `rows/step` (one per element, as fragments are element-
wise); the tables carry the dense optimizer's numbers (its step), so a dense backend forking from it finds them.
Restoring from a dense checkpoint, lazy AdamW's per-row steps are the dense step (dense AdamW moves every row).

A GEO worker writes (psarch/ps/worker/rows.py) its RowCache: the cached keys in arrival order (its record), and
per cached row one fragment of private keys `worker<R>/cache` (the locally trained row), `.../cache_synced` (as
pulled) and `.../cache_<state>` (its row optimizer's state; `step`: one number)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from psarch.checkpoint.fragments import Fragment
from psarch.config import Config
from psarch.flat import flat_layout
from psarch.ps.layout import Layout, meta_model
from psarch.ps.rows import KeySpace, dense_params
from psarch.embeddings import embedding_tables

if TYPE_CHECKING:
    from psarch.ps.worker.row_cache import RowCache

ROW_STEP = "rows/step"   # lazy AdamW's per-row step counts (no dense optimizer has them)


def row_model_layout(cfg: Config) -> tuple[Layout, list[str]]:
    """(each dense parameter's name, shape and offset in the dense flat vector; the tables' parameter names),
    from the model built on the meta device."""
    model = meta_model(cfg)
    return flat_layout(model, dense_params(model)), [name for name, _ in embedding_tables(model)]


def shard_fragments(space: KeySpace, index: int, names: list[str], tensors: dict[str, torch.Tensor],
                    scalars: dict[str, float]) -> list[Fragment]:
    """One strided fragment per table of server `index`'s shard: `tensors` are its (local rows, dim) tensors by
    key (PARAM, optimizer state), whose local row i holds key index + i * servers."""
    out, dim, s = [], space.dim, space.servers
    for name, offset, rows in zip(names, space.offsets(), space.rows):
        first_key = offset + (index - offset) % s          # this server's first key in the table
        if first_key >= offset + rows:
            continue
        local, count = first_key // s, -(-(offset + rows - first_key) // s)
        views = {k: t[local:local + count].reshape(-1) for k, t in tensors.items()}
        out.append(Fragment(name, (rows, dim), (first_key - offset) * dim, views, dict(scalars), row_stride=s))
    return out


def cache_fragments(cache: RowCache, space: KeySpace, names: list[str], rank: int) -> list[Fragment]:
    """A GEO worker's RowCache as one fragment per cached row, at its place in its table: private keys for the
    row, its pulled copy and its row optimizer's state (views into the cache's tensors, in the cache's order)."""
    own = f"worker{rank}/"
    offsets = torch.tensor(space.offsets())
    tables = torch.searchsorted(offsets, cache.keys, right=True) - 1
    state = {own + "cache": cache.rows, own + "cache_synced": cache.synced,
             **{own + "cache_" + k: v.unsqueeze(1) if v.dim() == 1 else v for k, v in cache.optim.state.items()}}
    out = []
    for i, (key, t) in enumerate(zip(cache.keys.tolist(), tables.tolist())):
        row = key - space.offsets()[t]
        out.append(Fragment(names[t], (space.rows[t], space.dim), row * space.dim,
                            {k: v[i] for k, v in state.items()}))
    return out
