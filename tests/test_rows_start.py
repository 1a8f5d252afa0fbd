"""Issue 11: with `backend.embeddings = "rows"` no PS process, and with "sharded" no ddp rank, holds the whole
embedding tables at start-up.

DLRM's tables draw from their own generators (models/dlrm.py `table_rows`): any subset of a table's rows is
bit-identical to the materialised table's, and the dense layers start the same with or without the tables.
A PS-rows worker builds its model with the tables on meta; a row server, or a sharded ddp rank (its model's
tables on meta too), computes only its shard. With tables
of 4 x 2*10^6 x 16 fp32 (512 MB), each one's peak RSS (ru_maxrss) grows by far less than the tables."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from psarch.config import from_dict
from psarch.models.dlrm import DLRM, TABLE_BLOCK, table_rows
from psarch.ps.rows import key_space
from psarch.ps.server.row_shard import initial_shard
from psarch.workload import build_workload
from timing import scaled

ROOT = Path(__file__).resolve().parents[1]
BIG = {"num_tables": 4, "rows": 2_000_000, "dim": 16, "bag": 1, "bottom_mlp": [8], "top_mlp": [8]}
TABLE_BYTES = 4 * 2_000_000 * 16 * 4


def _config(kind: str, dlrm: dict, servers: int = 3) -> dict:
    backend = {"single": {"kind": "single"}, "ddp": {"kind": "ddp", "embeddings": "sharded"},
               "ps": {"kind": "ps", "servers": servers, "embeddings": "rows", "auth": "none"}}[kind]
    return {"seed": 7, "backend": backend, "train": {"optimizer": "sgd", "lr": 0.1, "global_batch": 8},
            "workload": {"model": "dlrm", "data": "clicks", "dlrm": dlrm, "clicks": {"dense": 4}}}


def test_any_rows_of_a_table_equal_the_materialised_table():
    rows = 2 * TABLE_BLOCK + 5   # three blocks, the last one short
    weight = DLRM(4, 2, rows, 3, seed=9).tables[1].weight.detach()
    for start, step in [(0, 1), (0, 3), (2, 3), (TABLE_BLOCK + 1, 7), (rows - 1, 2), (rows, 1)]:
        chunks = list(table_rows(9, 1, rows, 3, start, step))
        assert all(c.shape[0] <= TABLE_BLOCK for c in chunks)
        got = torch.cat(chunks) if chunks else torch.empty(0, 3)
        assert torch.equal(got, weight[start::step]), (start, step)
    assert not torch.equal(weight, DLRM(4, 2, rows, 3, seed=10).tables[1].weight)   # the seed matters
    with pytest.raises(ValueError, match="step=0"):
        next(table_rows(9, 1, rows, 3, 0, 0))


def test_ps_rows_model_has_meta_tables_and_the_same_dense_layers():
    dlrm = {"num_tables": 3, "rows": 50, "dim": 4, "bag": 2, "bottom_mlp": [8], "top_mlp": [8]}
    full = build_workload(from_dict(_config("single", dlrm))).model
    lean = build_workload(from_dict(_config("ps", dlrm))).model
    assert all(t.weight.device.type == "meta" for t in lean.tables)
    assert all(t.weight.device.type == "cpu" for t in full.tables)
    for (name, a), (_, b) in zip(full.blocks.named_parameters(), lean.blocks.named_parameters()):
        assert torch.equal(a, b), name


def test_each_servers_shard_is_its_rows_of_the_materialised_tables():
    dlrm = {"num_tables": 3, "rows": 50, "dim": 4, "bag": 2, "bottom_mlp": [8], "top_mlp": [8]}
    tables = torch.cat([t.weight.detach() for t in build_workload(from_dict(_config("single", dlrm))).model.tables])
    cfg = from_dict(_config("ps", dlrm, servers=4))   # 50 rows per table: the tables' keys start at 0, 50, 100
    space = key_space(cfg)
    for s in range(4):
        assert torch.equal(initial_shard(cfg, space, s), tables[s::4]), s


_PEAK = """
import json, resource, sys, types
import torch
from collective.sharded import ShardedTables
from psarch.config import from_dict
from psarch.workload import click_model
from psarch.ps.server.start import row_server
def build(cfg):
    if sys.argv[1] == "worker":
        click_model(cfg)   # the worker's model; its data source (the hidden model) is not the tables
    elif sys.argv[1] == "sharded":   # rank 0 of 8 as DDPTrainer builds it; the constructor moves nothing
        ShardedTables(click_model(cfg), types.SimpleNamespace(world_size=8, rank=0), cfg, torch.device("cpu"))
    else:
        row_server(0, cfg, "127.0.0.1", 0).close()
big = json.loads(sys.argv[2])
small = dict(big, workload=dict(big["workload"], dlrm=dict(big["workload"]["dlrm"], rows=8)))
build(from_dict(small))   # torch's own start-up allocations (about 70 MB) fall before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
build(from_dict(big))
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024))
"""


LIMITS = {"worker": TABLE_BYTES // 64, "server": TABLE_BYTES // 4, "sharded": 3 * TABLE_BYTES // 8}


@pytest.fixture(scope="module")
def peaks():
    """Each builder's own process, the three started together (each measures only its own peak RSS); who -> the
    finished process (its return code, stdout, stderr)."""
    started = {}
    for who in LIMITS:
        cfg = json.dumps(_config("ddp" if who == "sharded" else "ps", BIG, servers=8))
        started[who] = subprocess.Popen([sys.executable, "-c", _PEAK, who, cfg], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    done = {}
    try:
        for who, p in started.items():
            out, err = p.communicate(timeout=scaled(240))
            done[who] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in started.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


@pytest.mark.parametrize("who,limit", LIMITS.items())
def test_start_up_peak_memory_is_far_below_the_tables(peaks, who, limit):
    # 8 servers, or 8 ddp ranks: server 0 / rank 0 holds 1/8 of the rows (64 MB), computed a block at a time;
    # a sharded rank also holds its shard's gradient (another 64 MB)
    out = peaks[who]
    assert out.returncode == 0, out.stderr[-2000:]
    grown = json.loads(out.stdout.strip().splitlines()[-1])
    assert grown < limit, f"{who}: peak RSS grew by {grown / 2**20:.0f} MiB; the tables are {TABLE_BYTES / 2**20:.0f} MiB"
