"""A PS worker's embedding treatment behind psarch.embeddings.EmbeddingTables (psarch/ps/worker/tables.py, rows.py),
without servers: "dense" moves nothing beside the flat vector; "rows" fetches the batch's rows, remaps its ids to
them, and sends their gradients ahead of the dense push, to the servers that own them. A stand-in client answers
as servers would, each row holding its key, so every row can be traced to where it came from."""
from __future__ import annotations

import torch

from psarch.config import from_dict
from psarch.embeddings import EmbeddingTables, unique_ids
from psarch.ps.rows import key_space
from psarch.ps.worker.rows import WorkerRows
from psarch.ps.worker.tables import PSTables
from psarch.workload import build_workload

DLRM = {"seed": 3, "workload": {"model": "dlrm", "data": "clicks",
                                "dlrm": {"num_tables": 2, "rows": 50, "dim": 4, "bag": 2, "bottom_mlp": [4],
                                         "top_mlp": [4]}},
        "train": {"steps": 2, "global_batch": 8},
        "backend": {"kind": "ps", "mode": "sync", "servers": 2, "world_size": 2, "embeddings": "rows"}}


class KeyedServers:
    """Answers rowpull with rows whose every entry is the row's key, rowfetch with a server's whole shard so."""

    def __init__(self, cfg) -> None:
        self.space = key_space(cfg)
        self.asked: list[list[int]] = []

    def exchange(self, requests) -> None:
        for server, reqs in enumerate(requests):
            for r in reqs:
                if r.header["op"] == "rowpull":
                    keys = r.tensor
                    assert bool((keys % self.space.servers == server).all()), "a key sent to a server not its owner"
                    self.asked.append(keys.tolist())
                    r.into.copy_(keys.float()[:, None].expand(-1, self.space.dim))
                else:
                    keys = torch.arange(server, self.space.total, self.space.servers)
                    r.into = keys.float()[:, None].expand(-1, self.space.dim).contiguous()


def test_dense_treatment_moves_nothing():
    tables, batch = PSTables(), (torch.ones(2, 3), torch.zeros(2, 1, 1, dtype=torch.int64), torch.ones(2))
    assert isinstance(tables, EmbeddingTables)
    assert tables.fetch(batch) is batch
    assert tables.exchange(batch, []) == {} and tables.step() is False
    assert tables.before_push(1, [0, 0]) is None
    assert (tables.full_tables(), tables.fragments(), tables.record(), tables.memory()) == ({}, [], {}, {})


def test_rows_fetch_remap_and_push_to_owners():
    cfg = from_dict(DLRM)
    workload = build_workload(cfg, device="meta")
    servers = KeyedServers(cfg)
    rows = WorkerRows(workload.model, cfg, servers, torch.float32, torch.device("cpu"), rank=0)
    assert isinstance(rows, EmbeddingTables)
    batch = workload.batch(0, 0, 2)
    offsets = servers.space.offsets()
    fetched = rows.fetch(batch)
    ids, local = batch[1], fetched[1]
    for t, table in enumerate(workload.model.tables):   # each id now reads the row of its key
        assert torch.equal(table.weight[local[:, t]][..., 0], (ids[:, t] + offsets[t]).float())
    want = sum(len(u) for u in unique_ids(batch))
    assert sum(len(k) for k in servers.asked) == want   # each distinct (table, id) pulled once

    grads = [torch.randn_like(t.weight) for t in workload.model.tables]
    for t, g in zip(workload.model.tables, grads):
        t.weight.grad = g
    assert rows.exchange(fetched, []) == {"unique_ids": want}
    pushes = rows.before_push(0, [5, 5])
    every = torch.cat(grads)
    for server, req in enumerate(pushes):   # each server gets the gradients of the rows it owns, with their keys
        assert req.header == {"op": "rowpush", "step": 0, "version": 5}
        assert bool((req.keys % 2 == server).all())
        pos = torch.searchsorted(rows.keys, req.keys)
        assert torch.equal(req.tensor, every[pos])
    assert sum(len(r.keys) for r in pushes) == want

    whole = rows.full_tables()   # the servers' shards, back in table order, under the tables' parameter names
    assert list(whole) == [f"tables.{t}.weight" for t in range(2)]
    for t, w in enumerate(whole.values()):
        assert torch.equal(w[:, 0], torch.arange(50).float() + offsets[t])
