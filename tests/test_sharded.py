"""ddp with `backend.embeddings = "sharded"` (collective/sharded.py): row-sharded tables, all-to-all.

At N = 3 (40 rows: shards of 14, 14 and 12 rows, the last padded) with SGD, Adagrad and AdamW, the run ends
with the same model as `single` (tests/parity.py tolerances; model.pt holds the whole tables, gathered from
the shards); each rank holds a third of the tables; the all-to-all bytes of every step equal theory's
formula given the step's measured id counts; a checkpoint written by the shards resumes bit-exactly and
holds the whole tables (single continues it). N = 2 is in tests/test_dlrm.py's parity variants."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from collective.sharded import owners, rows_per_rank
from dist_utils import run_ranks
from parity import OPTIMIZERS, assert_same_model, config, model, train
from collective import theory as collective_theory
from psarch import theory
from psarch.config import from_dict
from test_dlrm import SPARSE_OPTIMIZERS, TINY_DLRM
from timing import scaled

N = 3
ROWS, DIM, TABLES = TINY_DLRM["workload"]["dlrm"]["rows"], TINY_DLRM["workload"]["dlrm"]["dim"], 3
OPTS = {**SPARSE_OPTIMIZERS, "adamw": OPTIMIZERS["adamw"]}   # AdamW: untouched rows move on their moments


def test_owners_are_ranges_of_row_ids():
    assert [rows_per_rank(40, 3), rows_per_rank(42, 3), rows_per_rank(2, 3)] == [14, 14, 1]   # rank 2 of 2 rows: none
    assert owners(torch.tensor([0, 13, 14, 27, 28, 39]), 40, 14).tolist() == [0, 0, 1, 1, 2, 2]
    for bad in ([3, 40], [-1, 5]):
        with pytest.raises(ValueError, match=f"ids from {min(bad)} to {max(bad)}: a table has rows 0 to 39"):
            owners(torch.tensor(bad), 40, 14)


def _data(name: str, opt: str, n: int) -> dict:
    backend = {"kind": "ddp", "comm": "ring", "embeddings": "sharded"} if n > 1 else {"kind": "single"}
    return config(name, base=TINY_DLRM, train=OPTS[opt], backend=dict(backend, world_size=n))


def _sharded(rank: int, n: int, out: str) -> dict:
    """Every optimizer's run; Adagrad's writes a checkpoint at step 3 and is resumed from it."""
    results = {opt: train(rank, n, _data(f"sharded-{opt}", opt, n), {}, out) for opt in ("sgd", "adamw")}
    data = _data("sharded-adagrad", "adagrad", n)
    data["train"]["checkpoint_every"] = 3
    results["adagrad"] = train(rank, n, data, {}, out, checkpoints=Path(out) / "ckpt")
    train(rank, n, _data("sharded-adagrad-resumed", "adagrad", n), {}, out, start=_ckpt(out), resume=True)
    return results


def _ckpt(out: str | Path) -> Path:
    return Path(out) / "ckpt" / "step_000003"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("sharded")
    for opt in OPTS:
        train(0, 1, _data(f"single-{opt}", opt, 1), {}, str(out))
    results = run_ranks(_sharded, N, str(out), timeout=scaled(300))
    # single continues the sharded checkpoint: it holds every row of every table, and their Adagrad sums
    train(0, 1, _data("single-from-sharded", "adagrad", 1), {}, str(out), start=_ckpt(out))
    return out, results


@pytest.mark.parametrize("opt", list(OPTS))
def test_sharded_equals_single(runs, opt):
    out, _ = runs
    assert_same_model(model(out, f"sharded-{opt}"), model(out, f"single-{opt}"), f"ddp sharded {opt} N={N}")


def test_a_sharded_checkpoint_resumes_bit_exactly_and_holds_the_whole_tables(runs):
    out, _ = runs
    straight = model(out, "sharded-adagrad")
    resumed = model(out, "sharded-adagrad-resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), "resume is not bit-exact"
    assert_same_model(model(out, "single-from-sharded"), straight, "single from a sharded N=3 checkpoint")


def test_each_rank_holds_its_shard_of_the_tables(runs):
    _, results = runs
    block = -(-ROWS // N)
    for rank, r in enumerate(results):
        extra = r["adagrad"]["extra"]
        assert extra["table_bytes"] == TABLES * ROWS * DIM * 4
        assert extra["embedding_bytes"] == TABLES * block * DIM * 4    # ceil(rows / N) rows of each table
        mem = r["adagrad"]["memory"]
        pad_rows = block - (min((rank + 1) * block, ROWS) - rank * block)
        # padding rows: fp32 param + grad + Adagrad's sum, each 4 B
        assert mem["padding"] == TABLES * pad_rows * DIM * 12
    dense = results[0]["adagrad"]["params"] - TABLES * ROWS * DIM
    pred = theory.predict(from_dict(_data("p", "adagrad", N)), results[0]["adagrad"]["params"]).memory_per_rank
    assert pred.params == 4 * (dense + TABLES * block * DIM)
    # measured: the dense flat, the shard, and Adagrad's sums (+ a 4-byte step counter per stepped tensor)
    assert 0 <= results[0]["adagrad"]["memory"]["total"] - pred.total <= 4 * 2


def test_all_to_all_bytes_equal_the_formula_given_the_counts(runs):
    _, results = runs
    steps = TINY_DLRM["train"]["steps"]
    for r in results:
        ops = r["sgd"]["traffic"]["ops"]
        assert ops["all_to_all"]["calls"] == 4 * steps   # counts, ids, rows in forward; gradients in backward
        ring = ops["all_reduce"]["sent"] / steps
        for row in r["sgd"]["rows"]:
            c = row["extra"]
            assert c["ids_out"] <= c["unique_ids"]
            sent, received = collective_theory.sharded_bytes(c["ids_out"], c["ids_in"], TABLES, DIM, 4, N)
            assert (row["sent"] - ring, row["received"] - ring) == (sent, received)
    # every id one rank sends out, its owner receives
    for i in range(steps):
        assert sum(r["sgd"]["rows"][i]["extra"]["ids_out"] for r in results) == \
            sum(r["sgd"]["rows"][i]["extra"]["ids_in"] for r in results)
