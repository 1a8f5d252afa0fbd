"""Checkpoints of the parameter server's embedding rows (psarch/ps/row_snapshot.py): ps rows sync resumes bit for
bit at N = 2 (SGD, Adagrad, SGD with top-k dense pushes and their error feedback); async (lazy AdamW) and GEO (mid-round, its RowCache full) restore exactly the
state they saved; a ps rows checkpoint forks onto ddp rows, ddp sharded and single, and a dense ddp one
onto ps rows, within tests/parity.py's tolerance; every server writes its shard of each table as one strided fragment."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import parity
import ps_rows_checkpoint_runs as pr
from psarch.checkpoint import Checkpoint, consolidated_state_dict
from ps_setup import run_stage


def _stage(out: Path, stage: str, fn) -> list:
    return run_stage(out, pr.servers(out, stage), fn, pr.N)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps_rows_ckpt")
    return out, _stage(out, "straight", pr.straight), _stage(out, "resumed", pr.resumed)


@pytest.mark.parametrize("case", pr.EXACT)
def test_sync_rows_resume_is_bit_exact(runs, case):
    out, straight, resumed = runs
    a, b = parity.model(out, case), parity.model(out, f"{case}-resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), case
    for rank in range(pr.N):   # the resumed run's losses, the carried rows of steps 0-2 included
        assert resumed[rank][case] == straight[rank][case], (case, rank)


def _stored(path: Path) -> tuple[dict, dict[tuple[str, str, int], torch.Tensor]]:
    """The checkpoint's JSON state and every stored fragment's values, by (parameter, key, offset)."""
    ckpt = Checkpoint(path)
    try:
        return ckpt.state, {(e["name"], e["key"], e["offset"]): ckpt._load(e, e["name"], e["key"], 0, e["numel"])
                            for e in ckpt.meta["fragments"]}
    finally:
        ckpt.close()


@pytest.mark.parametrize("case", pr.RESTORED)
def test_restored_state_equals_the_saved_state(runs, case):
    """Restore every server and worker from checkpoint 3 and write them again: every record and tensor (the
    shards' rows and row optimizer state, GEO's RowCache) is the same, bit for bit."""
    out, _, _ = runs
    saved_state, saved = _stored(pr.checkpoint(out, case))
    again_state, again = _stored(out / f"{case}-again" / "checkpoints" / f"step_{pr.AT:06d}")
    assert again_state == saved_state
    assert saved.keys() == again.keys()
    for key in saved:
        assert torch.equal(saved[key], again[key]), key
    keys = {k for _, k, _ in saved}
    if case.startswith("geo"):   # mid-round: each worker's cache holds rows it trained since the last sync
        assert {"worker0/cache", "worker1/cache_synced", "worker1/cache_sum"} <= keys, keys
        assert all(w["cache_keys"] for w in saved_state["ps"]["workers"])
        cached = [k for k in saved if k[1] == "worker0/cache"]
        assert any(not torch.equal(saved[k], saved[(k[0], "worker0/cache_synced", k[2])]) for k in cached)
    else:   # the servers' lazy AdamW moments by torch's names, and each row's own step count
        assert {"exp_avg", "exp_avg_sq", "rows/step"} <= keys, keys
        steps = torch.cat([v for (n, k, _), v in saved.items() if k == "rows/step"])
        assert steps.max() <= pr.N * pr.AT and steps.unique().numel() > 2   # rows touched different times


def test_a_ps_rows_checkpoint_forks_onto_ddp_rows_sharded_and_single(runs):
    out, _, _ = runs
    reference = parity.model(out, "sync-adagrad")   # the straight ps rows run to step 6
    for fork in pr.FORKS:
        parity.assert_same_model(parity.model(out, fork), reference, f"ps rows -> {fork}")


def test_a_dense_ddp_checkpoint_forks_onto_ps_rows(runs):
    out, _, _ = runs
    parity.assert_same_model(parity.model(out, "from-dense"), parity.model(out, "dense"), "ddp dense -> ps rows")


def test_each_server_writes_its_shard_of_every_table_as_one_strided_fragment(runs):
    out, _, _ = runs
    path = pr.checkpoint(out, "sync-adagrad")
    meta = json.loads((path / "metadata.json").read_text())
    tables = [e for e in meta["fragments"] if e["name"].startswith("tables.") and e["key"] == "param"]
    assert sorted((e["file"], e["name"], e["offset"], e["numel"], e["row_stride"]) for e in tables) == [
        (f"server{s}.bin", f"tables.{t}.weight", s * 4, 50 * 4, 2) for s in range(2) for t in range(2)]
    assert meta["state_keys"] == ["sum"]
    assert meta["params"]["tables.0.weight"]["scalars"] == {"step": float(pr.AT)}   # the dense Adagrad's
    # consolidated one parameter at a time: the whole model at step 3, as the dense ddp run had it then
    parity.assert_same_model(dict(consolidated_state_dict(path)),
                             dict(consolidated_state_dict(pr.checkpoint(out, "dense"))), "consolidated ps rows")


def test_strided_fragments_reassemble_into_any_range_and_any_other_stride(tmp_path):
    """Three servers' shards of a 7 x 3 table (rows s, s + 3, ...): every range reads back, and each shard of
    a 1-, 2-, 3- or 4-server layout fills from them."""
    from psarch.checkpoint.fragments import PARAM, Fragment, Pieces
    from psarch.checkpoint.writer import merge, write_part

    table, servers = torch.randn(7, 3), 3
    for s in range(servers):
        shard = table[s::servers].clone()
        write_part(Pieces([Fragment("t", (7, 3), s * 3, {PARAM: shard.view(-1), "sum": (2 * shard).view(-1)},
                                    row_stride=servers)], {"t": (7, 3)}), tmp_path, f"server{s}")
    merge(tmp_path, [f"server{s}" for s in range(servers)], 1, {}, {"t": (7, 3)}, {}, 0)
    ckpt = Checkpoint(tmp_path)
    ckpt.verify()
    flat = table.view(-1)
    for lo in range(21):
        for hi in range(lo + 1, 22):
            assert torch.equal(ckpt.read("t", PARAM, lo, hi), flat[lo:hi]), (lo, hi)
    for other in (1, 2, 3, 4):
        for s in range(other):
            got = torch.empty_like(table[s::other])
            ckpt.fill(Fragment("t", (7, 3), s * 3, {"sum": got.view(-1)}, row_stride=other))
            assert torch.equal(got, 2 * table[s::other]), (other, s)
    ckpt.close()


@pytest.mark.parametrize("edit, says", [({"row_stride": 0}, "row_stride 0 of 't' is not a positive integer"),
                                        ({"offset": 1}, "is not whole rows of a 2-D parameter")])
def test_a_bad_strided_fragment_is_refused_in_one_line(tmp_path, edit, says):
    from psarch.checkpoint.fragments import PARAM, Fragment, Pieces
    from psarch.checkpoint.reader import CheckpointError
    from psarch.checkpoint.writer import merge, write_part

    table = torch.randn(4, 3)
    write_part(Pieces([Fragment("t", (4, 3), 0, {PARAM: table.view(-1)}, row_stride=1)], {"t": (4, 3)}),
               tmp_path, "server0")
    merge(tmp_path, ["server0"], 1, {}, {"t": (4, 3)}, {}, 0)
    meta = json.loads((tmp_path / "metadata.json").read_text())
    meta["fragments"][0].update(edit)
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=says) as e:
        Checkpoint(tmp_path)
    assert "\n" not in str(e.value)
