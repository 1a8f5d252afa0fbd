"""Compressed pushes beside the PS's embedding rows (backend.kind = "ps", embeddings = "rows", sync): the dense
partitions' pushes cast to 2 bytes or sent as top-k pairs (psarch/ps/worker/topk.py), the rows' pulls and pushes
whole, on dlrm/clicks at N = 2, one server holding the dense range whole, SGD, 4 steps, one thread per rank; the same
in async and ssp (bound 1), whose workers push and pull as sync's do, the server applying each push (top-k: its pairs
made dense) as it arrives; and in GEO (k = 1 with the barrier, k = 2 without), whose workers push each round's dense
delta compressed and pull the servers' compressed change since what they hold (pushpulldelta), the rows whole.

Tolerances: with one server holding one partition the PS selects what ddp's one bucket selects (as
tests/test_ps_compression.py finds without tables), so its top-k run equals ddp rows with top-k within SGD's 1e-5,
both summing the rows' gradients in fp32; fp16 (each worker's gradient rounded once at 2^-11, summed in fp32, |g| < 1,
4 SGD steps at lr 0.5) within 4 x 0.5 x 2^-11 ~ 1e-3 of the uncompressed run, and not equal to it."""
from __future__ import annotations

import math

import pytest
import torch

from parity import SGD_ATOL, assert_same_model, config, model, run_plan
from psarch.config import from_dict
from psarch.ps import theory as ps_theory
from ps_setup import ps
from test_compression_embeddings import dense_shapes
from test_ps_rows import OPTIMIZERS, ROWS_DLRM as DLRM

N, RATIO = 2, 0.25
STEPS, LR = DLRM["train"]["steps"], OPTIMIZERS["sgd"]["lr"]
FP16_ATOL = STEPS * LR * 2.0**-11
HEADER_BOUND = 128   # tests/test_ps.py's measured bound on a header frame
COMPRESSIONS = {"none": {}, "fp16": {"compression": "fp16"}, "topk": {"compression": "topk", "topk_ratio": RATIO}}
MODES = {"sync": {}, "async": {"mode": "async"}, "ssp": {"mode": "ssp", "staleness_bound": 1}}
RUNS = {**{f"ps-rows-{c}": (ps(N, "sync", 1, embeddings="rows"), c) for c in COMPRESSIONS},
        **{f"ps-rows-{m}-{c}": (ps(N, servers=1, embeddings="rows", **MODES[m]), c) for m in ("async", "ssp")
           for c in COMPRESSIONS},
        "ddp-rows-topk": ({"kind": "ddp", "embeddings": "rows", "world_size": N}, "topk")}


def _data(name: str) -> dict:
    backend, c = RUNS[name]
    return config(name, base=DLRM, train={**OPTIMIZERS["sgd"], **COMPRESSIONS[c]}, backend=backend)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps_rows_compression")
    return out, run_plan({name: _data(name) for name in RUNS}, {name for name in RUNS if name[:2] == "ps"}, N, out)


def pushed(compression: str) -> int:
    """Bytes of a worker's dense push a step: the range whole in fp32, cast to 2 bytes, or k (int64 index, fp32
    value) pairs."""
    d = sum(math.prod(s) for s in dense_shapes())
    return {"none": 4 * d, "fp16": 2 * d, "topk": math.ceil(RATIO * d) * (8 + 4)}[compression]


def test_top_k_beside_the_rows_equals_ddp_rows_and_fp16_stays_near(runs):
    out, _ = runs
    assert_same_model(model(out, "ps-rows-topk"), model(out, "ddp-rows-topk"), "ps rows vs ddp rows, topk", rtol=0,
                      atol=SGD_ATOL)
    none = model(out, "ps-rows-none")
    for c in ("topk", "fp16"):
        far = max((model(out, f"ps-rows-{c}")[k] - v).abs().max().item() for k, v in none.items())
        print(f"ps rows {c}: largest difference from uncompressed {far:.3g}")
        assert far > (100 * SGD_ATOL if c == "topk" else 0), c
    assert_same_model(model(out, "ps-rows-fp16"), none, "ps rows fp16 vs uncompressed", rtol=0, atol=FP16_ATOL)


def _name(mode: str, compression: str) -> str:
    return f"ps-rows-{compression}" if mode == "sync" else f"ps-rows-{mode}-{compression}"


def _trained_beside_the_rows(out, results: dict, mode: str) -> None:
    """Every step taken, every loss finite, the model finite and moved from `mode`'s uncompressed run (top-k: far)."""
    none = model(out, _name(mode, "none"))
    for c in ("fp16", "topk"):
        final = model(out, _name(mode, c))
        assert all(torch.isfinite(v).all() for v in final.values()), (mode, c)
        for rank in results[_name(mode, c)]:
            assert len(rank["rows"]) == STEPS and all(math.isfinite(r["loss"]) for r in rank["rows"]), (mode, c)
        far = max((final[k] - v).abs().max().item() for k, v in none.items())
        print(f"ps rows {mode} {c}: largest difference from uncompressed {far:.3g}")
        assert far > (100 * SGD_ATOL if c == "topk" else 0), (mode, c)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_train_beside_the_rows_with_compression(runs, mode):
    """Every step taken, every loss finite, the model finite and moved from the uncompressed run's (top-k: far)."""
    out, results = runs
    _trained_beside_the_rows(out, results, mode)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_the_rows_move_whole_and_the_dense_push_compressed(runs, mode, compression):
    """The rows' requests carry the uncompressed run's bytes to the byte; the dense push its formula plus a header
    a step (fp16: the same request as uncompressed, exactly 2 bytes an element fewer); pulls stay whole."""
    _, results = runs
    push = "sparsepushpull" if compression == "topk" else "pushpull"
    for rank in range(N):
        got = results[_name(mode, compression)][rank]["traffic"]["ops"]
        ref = results[_name(mode, "none")][rank]["traffic"]["ops"]
        for op in ("rowpull", "rowpush", "rowfetch"):
            assert got.get(op) == ref.get(op), (mode, compression, rank, op)   # rowfetch: rank 0 alone
        assert 0 < got[push]["sent"] - STEPS * pushed(compression) <= STEPS * HEADER_BOUND
        assert got[push]["received"] == ref["pushpull"]["received"]   # the dense range pulled whole
        if compression == "fp16":
            assert ref["pushpull"]["sent"] - got[push]["sent"] == STEPS * (pushed("none") - pushed("fp16"))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_theory_predicts_the_compressed_push_beside_the_rows(runs, mode, compression):
    """predict: the push's formula and the dense pull whole, plus rows_traffic at E[u] (headers not counted); its
    buffers top-k's error feedback, one fp32 error per dense element, as measured."""
    from psarch.theory import expected_unique_ids, predict

    _, results = runs
    name = _name(mode, compression)
    cfg, r = from_dict(_data(name)), results[name][0]
    p = predict(cfg, r["params"])
    rows = ps_theory.rows_traffic(expected_unique_ids(cfg), cfg.workload.dlrm.dim, 0, 4)
    assert p.link.sent - rows.sent == pytest.approx(pushed(compression), rel=1e-12)
    assert p.link.received - rows.received == pytest.approx(pushed("none"), rel=1e-12)
    d = sum(math.prod(s) for s in dense_shapes())
    assert p.memory_per_rank.buffers == r["memory"]["error_feedback"] == (4 * d if compression == "topk" else 0)


# GEO: k = 1 with the barrier (the servers keep one copy of what the workers hold and the round's delta), k = 2
# without (a copy for each worker); each beside its uncompressed run
GEO = {"geo1": {"mode": "geo", "k_steps": 1, "geo_barrier": True}, "geo2": {"mode": "geo", "k_steps": 2}}
GEO_RUNS = {f"ps-rows-{m}-{c}": (ps(N, servers=1, embeddings="rows", **GEO[m]), c) for m in GEO for c in COMPRESSIONS}


def _geo_data(name: str) -> dict:
    backend, c = GEO_RUNS[name]
    return config(name, base=DLRM, train={**OPTIMIZERS["sgd"], **COMPRESSIONS[c]}, backend=backend)


def _geo_ranks(rank: int, n: int, out: str, infos: dict) -> dict:
    from parity import train_plan
    return train_plan(rank, n, out, {name: _geo_data(name) for name in GEO_RUNS}, infos)


@pytest.fixture(scope="module")
def geo_runs(tmp_path_factory):
    """GEO_RUNS on N ranks, with the servers' statistics (their memory)."""
    from psarch.ps.services import start_services
    from ps_setup import run_with_stats

    out = tmp_path_factory.mktemp("ps_rows_geo_compression")
    services = {name: start_services(from_dict(_geo_data(name)), None, threads=True) for name in GEO_RUNS}
    results, stats = run_with_stats(out, services, _geo_ranks, N)
    return out, {name: [r[name] for r in results] for name in GEO_RUNS}, stats


@pytest.mark.parametrize("mode", list(GEO))
def test_geo_trains_beside_the_rows_with_compression(geo_runs, mode):
    """Every step taken, every loss finite, the model finite and moved from uncompressed GEO's (top-k: far)."""
    out, results, _ = geo_runs
    _trained_beside_the_rows(out, results, mode)


@pytest.mark.parametrize("mode", list(GEO))
@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_geo_moves_the_rows_whole_and_the_dense_deltas_compressed(geo_runs, mode, compression):
    """The rows' requests carry uncompressed GEO's bytes to the byte; each round's dense delta is pushed, and the
    servers' change since what the worker holds pulled, compressed: their formula plus a header each."""
    _, results, _ = geo_runs
    rounds = STEPS // GEO[mode]["k_steps"]
    op = "sparsepushpulldelta" if compression == "topk" else "pushpulldelta"
    for rank in range(N):
        got = results[_name(mode, compression)][rank]["traffic"]["ops"]
        ref = results[_name(mode, "none")][rank]["traffic"]["ops"]
        for row_op in ("rowpull", "rowpush", "rowfetch"):
            assert got.get(row_op) == ref.get(row_op), (mode, compression, rank, row_op)
        assert "pushpull" not in got and got[op]["calls"] == ref["pushpull"]["calls"] == rounds
        for way in ("sent", "received"):
            assert 0 < got[op][way] - rounds * pushed(compression) <= rounds * HEADER_BOUND, (mode, compression, way)


@pytest.mark.parametrize("mode", list(GEO))
@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_theory_predicts_geo_beside_the_rows_with_compression(geo_runs, mode, compression):
    """predict: the dense delta compressed both ways a round, plus rows_traffic at E[u_k] (headers not counted); a
    worker's top-k error feedback (one fp32 error per dense element) and a server's copies of what the workers hold
    of the dense part (one with the barrier, and its round's delta's wire bytes; else one a worker), as measured."""
    from psarch.theory import expected_unique_ids, predict

    _, results, stats = geo_runs
    name, every = _name(mode, compression), GEO[mode]["k_steps"]
    cfg, r = from_dict(_geo_data(name)), results[name][0]
    p, ref = predict(cfg, r["params"]), predict(from_dict(_geo_data(_name(mode, "none"))), r["params"])
    rows = ps_theory.rows_traffic(expected_unique_ids(cfg, every), cfg.workload.dlrm.dim, 0, 4)
    assert every * p.link.sent - rows.sent == pytest.approx(pushed(compression), rel=1e-12)
    assert every * p.link.received - rows.received == pytest.approx(pushed(compression), rel=1e-12)
    d = sum(math.prod(s) for s in dense_shapes())
    error = 4 * d if compression == "topk" else 0
    assert r["memory"]["error_feedback"] == error
    assert p.memory_per_rank.buffers - ref.memory_per_rank.buffers == error
    barrier = GEO[mode].get("geo_barrier", False)
    kept = 4 * d + pushed(compression) if barrier else 4 * N * d
    server, server_ref = stats[name]["memory"]["servers"][0], stats[_name(mode, "none")]["memory"]["servers"][0]
    assert server["buffers"] - server_ref["buffers"] == kept, (mode, compression)
    assert (p.nodes["server"].memory.buffers - ref.nodes["server"].memory.buffers) == kept
    assert p.nodes["server"].memory.buffers == server["buffers"], (mode, compression)


@pytest.mark.parametrize("mode", [*MODES, *GEO])
@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_the_step_program_sends_what_predict_says(mode, compression):
    """The step simulator's program (spec.program, in-process) has worker 0 send predict's bytes a step (GEO: a
    round's): the rows' keys and gradients, and the dense push as compressed, in every mode the combination runs in."""
    from psarch import registry
    from psarch.theory import predict
    from psarch.theory.program import DataStep, Transfer
    from psarch.workload import build_workload

    backend, c = {**RUNS, **GEO_RUNS}[_name(mode, compression)]
    cfg = from_dict(config("x", base=DLRM, train={**OPTIMIZERS["sgd"], **COMPRESSIONS[c]}, backend=backend))
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters())
    program = registry.spec_of(cfg).program(cfg, phi, DataStep.of(0.1), False)
    sent = sum(op.bytes * op.copies for op in program.ops if isinstance(op, Transfer) and op.src == 0)
    # GEO's program is a round's: k steps
    assert sent == pytest.approx(cfg.backend.push_every * predict(cfg, phi).link.sent, rel=1e-12), (mode, compression)
    data = _geo_data if mode in GEO else _data
    assert predict(cfg, phi).link.sent < predict(from_dict(data(_name(mode, "none"))), phi).link.sent
