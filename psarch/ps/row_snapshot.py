"""Checkpoints of the embedding rows (`backend.embeddings = "rows"`), in psarch.checkpoint's format.

A row server writes, beside its dense range (psarch/ps/snapshot.py), its shard of every table under the
table's parameter name (`tables.<t>.weight`): the rows it owns (key mod S = its index) are every S-th row
of a table, one strided fragment per table (Fragment.row_stride), so the reader reassembles any range of
a table and consolidates it one parameter at a time. The row optimizer's state goes by the dense
optimizers' names: Adagrad's `sum`, AdamW's `exp_avg` / `exp_avg_sq`; lazy AdamW's per-row step counts,
which no dense optimizer has, under the private key `rows/step` (one per element, as fragments are element-
wise); the tables carry the dense optimizer's numbers (its step), so a dense backend forking from it finds them.
Restoring from a dense checkpoint, lazy AdamW's per-row steps are the dense step (dense AdamW moves every row).

A GEO worker writes its RowCache: the cached keys in arrival order (its record), and per cached row one
fragment of private keys `worker<R>/cache` (the locally trained row), `.../cache_synced` (as pulled) and
`.../cache_<state>` (its row optimizer's state; `step`: one number)."""
from __future__ import annotations

from typing import Any

import torch

from psarch.checkpoint.fragments import PARAM, Fragment, Pieces, optimizer_views
from psarch.config import Config
from psarch.flat import flat_layout
from psarch.ps.layout import meta_model
from psarch.ps.rows import KeySpace, dense_params
from psarch.embeddings import embedding_tables

ROW_STEP = "rows/step"   # lazy AdamW's per-row step counts (no dense optimizer has them)

Layout = list[tuple[str, torch.Size, int]]


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


class RowSnapshots:
    """Mixed into RowServer (before ParameterServer): the dense layout without the tables, and the shard of
    every table in the server's part and restore."""

    def _layout(self) -> Layout:
        if self.layout is None:
            self.layout, self.table_names = row_model_layout(self.cfg)
        return self.layout

    def _table_scalars(self) -> dict[str, float]:
        """The dense optimizer's numbers (its step), which a dense backend forking from the tables needs."""
        st = self.state
        return optimizer_views(st.optim.optimizer, st.optim.master.params[0])[1] if st.optim is not None else {}

    def _row_tensors(self) -> dict[str, torch.Tensor]:
        sh = self.shard
        out = {PARAM: sh.rows}
        if sh.optim is not None:
            out.update({k: v for k, v in sh.optim.state.items() if k != "step"})
            if "step" in sh.optim.state:   # element-wise, as every fragment is
                out[ROW_STEP] = sh.optim.state["step"].unsqueeze(1).expand(-1, self.space.dim).contiguous()
        return out

    def _pieces(self) -> Pieces:
        pieces = super()._pieces()
        self._layout()
        pieces.fragments += shard_fragments(self.space, self.index, self.table_names, self._row_tensors(),
                                            self._table_scalars())
        for name, rows in zip(self.table_names, self.space.rows):
            pieces.params[name] = (rows, self.space.dim)
        return pieces

    def restore(self, ckpt: Any) -> None:
        """The dense range as ParameterServer restores it, then this server's rows and their optimizer state
        (each state the checkpoint holds for the tables; lazy AdamW's steps from the dense step without it)."""
        super().restore(ckpt)
        tensors = self._row_tensors()
        frags = shard_fragments(self.space, self.index, self.table_names, tensors, {})
        with torch.no_grad():
            for f in frags:
                for key in list(f.tensors):
                    if not ckpt.has(f.name, key):
                        del f.tensors[key]
                ckpt.fill(f)
        steps = self.shard.optim.state.get("step") if self.shard.optim is not None else None
        if steps is not None:
            if all(ckpt.has(f.name, ROW_STEP) for f in frags):
                steps.copy_(tensors[ROW_STEP][:, 0])
            else:   # a dense AdamW's step moved every row
                steps.fill_(int(ckpt.scalars(self.table_names[0]).get("step", 0)))


# ---------------------------------------------------------------------------------------------- GEO workers


def _cache_fragments(tr: Any) -> list[Fragment]:
    """One fragment per cached row, at its place in its table: private keys for the row, its pulled copy and
    its row optimizer's state (a copy of each, in the cache's order)."""
    c, own, space = tr.cache, f"worker{tr.ctx.rank}/", tr.space
    offsets = torch.tensor(space.offsets())
    tables = torch.searchsorted(offsets, c.keys, right=True) - 1
    state = {own + "cache": c.rows, own + "cache_synced": c.synced,
             **{own + "cache_" + k: v.unsqueeze(1) if v.dim() == 1 else v for k, v in c.optim.state.items()}}
    out = []
    for i, (key, t) in enumerate(zip(c.keys.tolist(), tables.tolist())):
        row = key - space.offsets()[t]
        out.append(Fragment(tr.table_names[t], (space.rows[t], space.dim), row * space.dim,
                            {k: v[i] for k, v in state.items()}))
    return out


def cache_pieces(tr: Any, pieces: Pieces) -> Pieces:
    """A GEO worker's part with its RowCache added (its keys in the record, its rows as fragments)."""
    pieces.fragments += _cache_fragments(tr)
    pieces.state["cache_keys"] = tr.cache.keys.tolist()
    return pieces


def restore_cache(tr: Any, ckpt: Any, record: dict[str, Any]) -> None:
    """Refill a GEO worker's RowCache as it was written: its keys in their order, rows, pulled copies, state."""
    c = tr.cache
    c.clear()
    keys = torch.tensor(record["cache_keys"], dtype=torch.int64)
    c.add(keys, torch.zeros(keys.numel(), tr.space.dim))
    with torch.no_grad():
        for f in _cache_fragments(tr):   # views into the cache's own tensors
            ckpt.fill(f)
