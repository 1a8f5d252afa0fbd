"""Gradient compression on the parameter server (`train.compression`, backend.kind = "ps"): pushes cast to 2 bytes
or sent as top-k pairs and summed by the servers (psarch/ps/server/rounds.py), their models against `single`'s and
ddp's top-k, their bytes and error-feedback memory against the formulas. Runs and tolerances as in
tests/test_compression.py (the tiny GPT, SGD with momentum, 8 steps; cast_bound, SGD's 1e-5)."""
from __future__ import annotations

import math

import pytest
import torch

from parity import SGD_ATOL, assert_same_model, config, model, train
from psarch.config import from_dict
from test_compression import RATIO, SGD, assert_within, cast_bound, data


TOPK = {"compression": "topk", "topk_ratio": RATIO}
PS_VARIANTS = {
    "ps-fp16": {"compression": "fp16"},
    "ps-bf16": {"compression": "bf16"},
    "ps-fp16-parts-prio": {"compression": "fp16"},
    "ps-topk": TOPK,
    "ps-topk-s1": TOPK,
    "ps-topk-parts-prio": TOPK,
    "ps-topk-all": {"compression": "topk", "topk_ratio": 1.0},
    # bf16 compute: the pushes' values are bf16, the servers' round sums fp32
    "ps-bf16-dense": {"precision": "bf16"},
    "ps-bf16-topk-all": {"compression": "topk", "topk_ratio": 1.0, "precision": "bf16"},
}


def ps_data(name: str, n: int) -> dict:
    from ps_setup import ps
    extra = {"partition_mb": 0.001, "priority_credit_mb": 0.001} if "parts" in name else {}
    servers = 1 if name.endswith("-s1") else 2
    return config(f"{name}-{n}", train={**SGD, **PS_VARIANTS[name]}, backend=ps(n, "sync", servers, **extra))


def every_ps_variant(rank: int, n: int, out: str, infos: dict) -> dict:
    runs = {name: train(rank, n, ps_data(name, n), infos[name], out) for name in PS_VARIANTS}
    runs["topk-ring"] = train(rank, n, data("topk-ring", n), {}, out)
    return runs


@pytest.fixture(scope="module")
def ps_runs(tmp_path_factory):
    from psarch.ps.services import start_services
    out = tmp_path_factory.mktemp("ps-compression")
    train(0, 1, config("single", train=SGD), {}, str(out))
    from ps_setup import ps, run_with_stats
    for mode in ("sync", "async"):   # one worker: an async server applies what a sync round would
        one = from_dict(config(f"ps-topk-{mode}-1", train={**SGD, **TOPK}, backend=ps(1, mode, 2)))
        service = start_services(one, None, threads=True)
        try:
            train(0, 1, one.to_dict(), service.info, str(out))
            service.finish()
        finally:
            service.stop()
    n = 2
    services = {name: start_services(from_dict(ps_data(name, n)), None, threads=True) for name in PS_VARIANTS}
    res, stats = run_with_stats(out, services, every_ps_variant, n)
    return out, res, stats


def test_ps_sums_pushes_cast_to_two_bytes(ps_runs):
    """Each worker's gradient rounded once to fp16 (bf16), summed in fp32 by the servers: within cast_bound of
    `single` (a looser bound than one rounding needs), yet not `single`'s model: the cast is real."""
    out, _, _ = ps_runs
    ref = model(out, "single")
    for name, unit_roundoff in (("ps-fp16", 2.0**-11), ("ps-bf16", 2.0**-8), ("ps-fp16-parts-prio", 2.0**-11)):
        mine = model(out, f"{name}-2")
        assert_within(mine, ref, cast_bound(unit_roundoff), f"{name} vs single")
        assert max((mine[k] - v).abs().max().item() for k, v in ref.items()) > SGD_ATOL, f"{name}: nothing cast"
    assert_same_model(model(out, "ps-fp16-parts-prio-2"), model(out, "ps-fp16-2"), "partitions from hooks vs whole",
                      rtol=0, atol=0)


def test_ps_top_k_sums_sparse_pushes(ps_runs):
    """Top-k through the PS: with one server holding the whole vector in one partition it selects exactly what
    ddp's one bucket selects, so it equals top-k by all-gather within SGD's 1e-5 (the PS sums the values, then
    divides by N; ddp divides, then sums: one rounding apart per step, none at N = 2); top-k of every element is
    exact averaging (`single`); with one worker an async server applies what a sync round does (bitwise); and
    a run of top-k is far from `single` (the compression is real)."""
    out, _, _ = ps_runs
    ref = model(out, "single")
    assert_same_model(model(out, "ps-topk-s1-2"), model(out, "topk-ring-2"), "ps top-k vs ddp top-k", rtol=0,
                      atol=SGD_ATOL)
    print("ps top-k vs ddp top-k:", max((model(out, "ps-topk-s1-2")[k] - v).abs().max().item()
                                        for k, v in model(out, "topk-ring-2").items()))
    assert_same_model(model(out, "ps-topk-all-2"), ref, "ps top-k of everything vs single", rtol=0, atol=SGD_ATOL)
    # a sparse sum of bf16 values into the fp32 round adds what the dense push adds, bit for bit
    assert_same_model(model(out, "ps-bf16-topk-all-2"), model(out, "ps-bf16-dense-2"), "bf16 top-k of everything",
                      rtol=0, atol=0)
    assert_same_model(model(out, "ps-topk-async-1"), model(out, "ps-topk-sync-1"), "async vs sync, one worker",
                      rtol=0, atol=0)
    for name in ("ps-topk-2", "ps-topk-parts-prio-2"):
        far = max((model(out, name)[k] - v).abs().max().item() for k, v in ref.items())
        assert far > 100 * SGD_ATOL, f"{name}: {far:g} from single"


def test_ps_top_k_bytes_and_error_feedback_equal_the_formula(ps_runs):
    """A worker pushes each partition's k = ceil(ratio x elements) pairs of an int64 index and a 4-byte value
    (+ a header per request) and pulls 4 Φ; it keeps 4 Φ of error feedback; theory predicts both."""
    from psarch.ps.layout import server_partitions
    from psarch.theory import predict
    _, res, stats = ps_runs
    header_bound = 128
    for name in ("ps-topk", "ps-topk-s1", "ps-topk-parts-prio"):
        layout = server_partitions(from_dict(ps_data(name, 2)), res[0][name]["params"])   # what the servers hold
        assert [len(p) for p in layout] == [x["partitions"] for x in stats[name]["servers_detail"]]
        sizes = [hi - lo for parts in layout for lo, hi in parts]
        pairs = sum(math.ceil(RATIO * size) for size in sizes) * (8 + 4)
        for r in res:
            phi = r[name]["params"]
            assert sum(sizes) == phi
            sent = sum(row["sent"] for row in r[name]["rows"])
            assert SGD["steps"] * pairs < sent <= SGD["steps"] * (pairs + 2 * len(sizes) * header_bound), name
            assert r[name]["memory"]["error_feedback"] == 4 * phi, name
        p = predict(from_dict(ps_data(name, 2)), res[0][name]["params"])
        assert (p.link.sent, p.memory_per_rank.buffers) == (pairs, 4 * phi), name


def test_ps_pushes_half_the_bytes_and_pulls_whole(ps_runs):
    """A worker sends 2 Φ bytes a step (+ a header per request) and receives 4 Φ; the servers receive what
    the workers sent; theory predicts both."""
    from psarch.theory import predict
    _, res, stats = ps_runs
    header_bound = 128   # tests/test_ps.py's measured bound on a header frame
    for name in ("ps-fp16", "ps-bf16", "ps-fp16-parts-prio"):
        parts = sum(x["partitions"] for x in stats[name]["servers_detail"])
        for r in res:
            phi, steps = r[name]["params"], SGD["steps"]
            # with priority a push and a pull request go per partition, and pulls straddle the steps' rows: its
            # pushes counted over the run (the pulls of the whole-range runs are checked row by row below)
            sent = sum(row["sent"] for row in r[name]["rows"])
            assert steps * 2 * phi < sent <= steps * (2 * phi + 2 * parts * header_bound), name
            for row in r[name]["rows"] if "prio" not in name else []:
                assert 2 * phi < row["sent"] <= 2 * phi + parts * header_bound, (name, row)
                assert 4 * phi < row["received"] <= 4 * phi + parts * header_bound, (name, row)
        assert sum(s["received"] for s in stats[name]["traffic"]["servers"]) == \
            sum(r[name]["traffic"]["sent"] for r in res)
        p = predict(from_dict(ps_data(name, 2)), res[0][name]["params"])
        assert (p.link.sent, p.link.received) == (2 * phi, 4 * phi)


def test_a_round_sums_top_k_pairs_sparsely_as_it_would_dense():
    """rounds.py: pairs summed in worker order, an early one kept as its pairs, give the bits of the dense sum."""
    from psarch.ps.server.rounds import OrderedSum, Pairs
    torch.manual_seed(0)
    pushes = []
    for _ in range(3):
        keys = torch.randperm(50)[:7]
        pushes.append(Pairs(keys, torch.randn(7)))
    dense = torch.zeros(50)
    for p in pushes:
        dense += p.dense(torch.empty(50))
    acc, rnd, pushed = torch.full((50,), float("nan")), OrderedSum(3), set()
    for w in (2, 1, 0):   # the last worker first: 2 and 1 wait as pairs, then all are summed in order
        rnd.add(w, pushes[w], acc, {0, 1, 2}, pushed)
        pushed.add(w)
        rnd.drain(acc, {0, 1, 2}, pushed)
    assert rnd.complete(pushed) and rnd.peak == pushes[1].nbytes + pushes[2].nbytes
    assert torch.equal(acc, dense)
