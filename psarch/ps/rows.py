"""Embedding tables on the parameter servers, sharded by row (`backend.embeddings = "rows"`).

Keys: the tables' rows are numbered one after another, key = (rows of the tables before t) + id, as
ps-lite numbers its keys. Server s of S owns the keys k with k mod S = s, at local row k // S: a hash of
the key (the cheapest one). Why not contiguous ranges: real id spaces are often assigned in order of
first appearance, so a range would put the hottest ids on one server; modulo spreads hot ids over every
server whatever their numbering (clicks data scatters them with a permutation, but a user's data need
not). Dense parameters are split over servers in flat ranges as before (psarch/ps/layout.py).

What servers and workers share is here: the key space, the dense part of the model, and the model's state
from the servers' shards. A server's rows are psarch/ps/server/row_shard.py's `RowShard` (served by
psarch/ps/server/rows.py), a worker's psarch/ps/worker/rows.py's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from psarch.config import Config, from_dict
from psarch.config.backend import PSServers
from psarch.embeddings import embedding_tables
from psarch.ps.layout import held, join_servers, server_partitions, trainable


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


def server_config(cfg: Config) -> Config:
    """The PS config the hybrid's servers (and its ranks' rows) run, from a collective backend's config with
    embeddings = "ps" (collective/ps_tables.py): sync, embeddings = "rows", its servers' options (PSServers), its
    workload and [train] (but its frozen parameters, LoRA adapters and gradient compression: the collective ranks'
    dense part's; the rows move whole), no [faults]."""
    b = cfg.backend
    data = cfg.to_dict()
    defaults = type(cfg.train)()
    data["train"].update({k: getattr(defaults, k) for k in ("trainable", "lora_rank", "lora_alpha", "lora_targets",
                                                            "compression", "topk_ratio", "powersgd_rank",
                                                            "powersgd_warmup_steps")})
    data.pop("faults", None)   # the launcher strikes them (and restarts the collective world), not a PS run
    data["backend"] = {"kind": "ps", "mode": "sync", "embeddings": "rows", "world_size": b.world_size,
                       "timeout_s": b.timeout_s, "device": b.device,
                       **{f.name: getattr(b, f.name) for f in dataclasses.fields(PSServers)}}
    return from_dict(data, cfg.name)


def dense_params(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters other than the embedding tables, in the order of the dense flat vector."""
    tables = {id(t.weight) for _, t in embedding_tables(model)}
    return [p for p in trainable(model) if id(p) not in tables]


def dense_flat(model: nn.Module) -> torch.Tensor:
    """A model's dense parameters as one flat fp32 vector (its tables may be on the meta device)."""
    return torch.cat([p.detach().reshape(-1).float() for p in dense_params(model)])


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


def join_parts(model: nn.Module, cfg: Config, space: KeySpace, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state_dict from what each server reported: its dense partitions (joined), then its rows."""
    numel = sum(p.numel() for p in dense_params(model))
    dense, shards = [], []
    for s, (own, part) in enumerate(zip(server_partitions(cfg, numel), parts)):
        if part.numel() != held(own) + space.owned(s) * space.dim:
            raise ValueError(f"server {s} reported {part.numel()} values, expected {held(own)} dense + "
                             f"{space.owned(s)} rows x {space.dim}")
        dense.append(part[:held(own)])
        shards.append(part[held(own):])
    return join_model(model, space, join_servers(cfg, dense), gather_shards(space, shards))
