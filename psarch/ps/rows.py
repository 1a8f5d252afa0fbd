"""Embedding tables on the parameter servers, sharded by row (`backend.embeddings = "rows"`).

Keys: the tables' rows are numbered one after another, key = (rows of the tables before t) + id, as
ps-lite numbers its keys. Server s of S owns the keys k with k mod S = s, at local row k // S: a hash of
the key (the cheapest one). Why not contiguous ranges: real id spaces are often assigned in order of
first appearance, so a range would put the hottest ids on one server; modulo spreads hot ids over every
server whatever their numbering (clicks data scatters them with a permutation, but a user's data need
not). Dense parameters are split over servers in flat ranges as before (psarch/ps/layout.py).

`RowShard` is one server's rows of every table, their row-wise optimizer (row_optim.py) and, in the
barrier modes, the rows pushed in the current round (summed over workers, then applied once).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from psarch.config import Config
from psarch.models.dlrm import table_rows
from psarch.ps.errors import PSError
from psarch.ps.layout import trainable
from psarch.ps.row_optim import RowOptimizer
from psarch.embeddings import embedding_tables


@dataclass(frozen=True)
class KeySpace:
    """How the rows of every table map to keys, and keys to servers."""

    rows: tuple[int, ...]     # rows per table
    dim: int
    servers: int

    @property
    def total(self) -> int:
        return sum(self.rows)

    def offsets(self) -> list[int]:
        """Key of row 0 of each table."""
        out, n = [], 0
        for r in self.rows:
            out.append(n)
            n += r
        return out

    def owned(self, server: int) -> int:
        """Rows server `server` holds: the keys k < total with k mod servers = server."""
        return max(0, -(-(self.total - server) // self.servers))

    def split(self, keys: torch.Tensor) -> list[torch.Tensor]:
        """Positions in `keys` of the keys each server owns (in the order of `keys`)."""
        owner = keys % self.servers
        return [torch.nonzero(owner == s).squeeze(1) for s in range(self.servers)]


def key_space(cfg: Config) -> KeySpace:
    """The run's key space (the dlrm model's tables: num_tables x rows x dim)."""
    d = cfg.workload.dlrm
    return KeySpace((d.rows,) * d.num_tables, d.dim, cfg.backend.servers)


def dense_params(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters other than the embedding tables, in the order of the dense flat vector."""
    tables = {id(t.weight) for _, t in embedding_tables(model)}
    return [p for p in trainable(model) if id(p) not in tables]


def dense_flat(model: nn.Module) -> torch.Tensor:
    """A model's dense parameters as one flat fp32 vector (its tables may be on the meta device)."""
    return torch.cat([p.detach().reshape(-1).float() for p in dense_params(model)])


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


def join_model(model: nn.Module, space: KeySpace, dense: torch.Tensor, tables: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's consolidated fp32 state_dict from its dense flat vector and its tables' rows (a worker's
    model, whose tables hold only a step's rows, names the parameters)."""
    masters, pos = {}, 0
    for p in dense_params(model):
        masters[id(p)] = dense[pos:pos + p.numel()].view(p.shape)
        pos += p.numel()
    if pos != dense.numel() or tuple(tables.shape) != (space.total, space.dim):
        raise ValueError(f"{dense.numel()} dense parameters and rows {tuple(tables.shape)}: the model has {pos} "
                         f"and ({space.total}, {space.dim})")
    for (_, t), lo, n in zip(embedding_tables(model), space.offsets(), space.rows):
        masters[id(t.weight)] = tables[lo:lo + n]
    out = {}
    for name, value in model.state_dict(keep_vars=True).items():
        src = masters.get(id(value), value).detach()
        out[name] = src.to("cpu", torch.float32 if src.is_floating_point() else src.dtype, copy=True)
    return out


def gather_shards(space: KeySpace, shards: list[torch.Tensor]) -> torch.Tensor:
    """Every table's rows (total, dim) from each server's shard (its rows in local order)."""
    out = torch.empty(space.total, space.dim)
    for s, rows in enumerate(shards):
        out[s::space.servers] = rows.reshape(-1, space.dim)
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
        """async / ssp: one row-wise optimizer step; geo: add the deltas (times `factor`)."""
        if self.geo:
            self.rows.index_add_(0, idx, values.float(), alpha=factor)
        else:
            self.optim.step(idx, values.float())

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

    def apply_round(self, factor: float) -> None:
        """Sum the round's rows over workers, times `factor` (sync: 1/N, the mean gradient), and apply once.
        The sum goes in worker order, not arrival order (index_add_ on CPU adds in source order), so that its
        bits do not depend on timing."""
        if self.round_idx:
            order = sorted(range(len(self.round_from)), key=self.round_from.__getitem__)
            idx, inverse = torch.unique(torch.cat([self.round_idx[i] for i in order]), return_inverse=True)
            values = torch.cat([self.round_values[i] for i in order])
            total = torch.zeros(idx.numel(), self.space.dim).index_add_(0, inverse, values)
            self.apply(idx, total.mul_(factor))
        self.round_idx, self.round_values, self.round_from = [], [], []

    def memory(self) -> dict[str, int]:
        """Bytes this shard holds, by category."""
        params = self.rows.numel() * 4
        optim = self.optim.state_bytes() if self.optim is not None else 0
        buffers = sum(t.numel() * t.element_size() for t in self.round_idx + self.round_values)
        return {"params": params, "optimizer": optim, "buffers": buffers}


def join_parts(model: nn.Module, space: KeySpace, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state_dict from what each server reported: its dense range, then its rows."""
    from psarch.ps.layout import server_ranges
    numel = sum(p.numel() for p in dense_params(model))
    dense, shards = [], []
    for s, ((lo, hi), part) in enumerate(zip(server_ranges(numel, space.servers), parts)):
        if part.numel() != hi - lo + space.owned(s) * space.dim:
            raise ValueError(f"server {s} reported {part.numel()} values, expected {hi - lo} dense + "
                             f"{space.owned(s)} rows x {space.dim}")
        dense.append(part[:hi - lo])
        shards.append(part[hi - lo:])
    return join_model(model, space, torch.cat(dense), gather_shards(space, shards))
