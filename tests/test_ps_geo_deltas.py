"""GEO's compressed pulls without a run (psarch/ps/server/deltas.py): a pull's bytes on the wire, what a top-k pull
leaves out going with the next, one copy shared by the workers of a barrier, the step simulator's GEO program, and
the refusals (a whole pull where the copy is shared, a pushpull with compression, a malformed delta, a checkpoint
without the copies restored exactly). The runs: tests/test_ps_geo_compression.py."""
from __future__ import annotations

import math

import pytest
import torch

from parity import config
from psarch.config import from_dict
from ps_setup import ps
from test_ps_geo_compression import N, RATIO, SERVERS, SGD


def test_a_compressed_pull_carries_the_formulas_bytes():
    """One pull's payload, encoded for the wire: top-k's k = ceil(ratio x size) pairs, 8 + 4 bytes each; a cast's
    2 bytes an element; and the worker that adds it ends with the server's copy of it, bit for bit."""
    from psarch.ps import wire
    from psarch.ps.server.deltas import WorkerCopies
    from psarch.ps.sparse import add_delta
    torch.manual_seed(0)
    size = 1000
    for dtype, ratio, payload in ((torch.float32, RATIO, math.ceil(RATIO * size) * 12), (torch.float16, None, 2 * size),
                                  (torch.bfloat16, None, 2 * size), (torch.float32, 1.0, size * 12)):
        params = torch.randn(size)
        server = WorkerCopies(params, 2, dtype, ratio, shared=False)
        worker, start = params.clone(), params.clone()
        for version in range(5):
            params += 0.01 * torch.randn(size)
            keys, values = server.delta(1, params, version)
            op = "sparsedelta" if keys is not None else "delta"
            frames = wire.encode({"op": op, "version": 1, "offset": 0}, values, keys)
            assert wire.frames_bytes(frames[1:]) == payload, (dtype, ratio)
            msg = wire.decode(frames)
            add_delta(worker, msg.keys() if keys is not None else None, msg.tensor())
            assert torch.equal(worker, server.copies[1]), (dtype, ratio)
        assert torch.equal(server.copies[0], start)   # worker 0 was sent nothing: its copy did not move
        if ratio == 1.0:   # every element sent: the copy is the parameters within one rounding
            torch.testing.assert_close(worker, params, rtol=0, atol=1e-6)


def test_what_a_top_k_pull_leaves_out_goes_with_the_next():
    """Downlink error feedback: with the parameters still, ceil(1 / ratio) pulls send every element of the change
    (each pull the k largest of what is left), and the worker then holds the parameters (to one rounding)."""
    from psarch.ps.server.deltas import WorkerCopies
    torch.manual_seed(1)
    params = torch.randn(500)
    server = WorkerCopies(params, 1, torch.float32, RATIO, shared=False)
    params += torch.randn(500)
    sent: set[int] = set()
    for version in range(math.ceil(1 / RATIO)):
        keys, _ = server.delta(0, params, version)
        assert not sent & set(keys.tolist())   # never the same element twice: what was sent is no longer missing
        sent |= set(keys.tolist())
    assert len(sent) == 500
    torch.testing.assert_close(server.copies[0], params, rtol=0, atol=1e-6)


def test_a_geo_server_with_compression_answers_a_pushpull_with_the_cast_change_only():
    """Driven on the wire: a whole pull (start-up) sets what the worker holds; a `pushpull` (whole parameters back)
    is refused in one line; a `pushpulldelta` of fp16 d is added to the parameters and answered with the fp16 change
    since the pulled model, ((start + d) - start) cast; a sync server refuses a `pushpulldelta`."""
    import zmq
    from psarch.ps.services import start_services
    from psarch.workload import build_workload
    from ps_setup import Raw
    zctx, started = zmq.Context(), []
    try:
        for mode in ("geo", "sync"):
            cfg = from_dict(config(f"srv-{mode}", train={"optimizer": "sgd", "lr": 0.5, "compression": "fp16"},
                                   workload={"model": "mlp"}, backend=ps(1, mode, 1)))
            started.append(start_services(cfg, None, threads=True))
            numel = sum(p.numel() for p in build_workload(cfg).model.parameters())
            raw = Raw(zctx, started[-1].info.addresses[0], started[-1].info.auth, 0)
            push = {"worker": 0, "step": 0, "version": 0, "offset": 0}
            d = (0.01 * torch.randn(numel)).half()
            if mode == "sync":
                r = raw.ask({"op": "pushpulldelta", **push}, d)
                assert r.op == "error" and "pulls carry parameters whole" in r.header["message"], r.header
                continue
            pulled = raw.ask({"op": "pull", "worker": 0, "step": 0, "want": "float32"})
            assert pulled.op == "params"
            r = raw.ask({"op": "pushpull", **push}, d)
            assert r.op == "error" and "carry compressed deltas" in r.header["message"], r.header
            r = raw.ask({"op": "pushpulldelta", **push}, d)
            assert r.op == "delta" and r.shape == (numel,), r.header
            start = pulled.tensor()
            assert torch.equal(r.tensor(), ((start + d.float()) - start).half())
    finally:
        for s in started:
            s.stop()
        zctx.destroy(linger=0)


@pytest.mark.parametrize("compression", ["topk", "fp16"])
def test_a_compressed_geo_program_moves_theorys_bytes_both_ways(compression):
    """The step simulator's GEO program (barrier, k = 1, one server, its range whole; compute 0, no latency): N
    compressed pushes in through the server's link, then N compressed pulls out, theory's bytes each way."""
    from psarch import registry
    from psarch.theory import predict
    from psarch.theory.program import Cluster, DataStep
    from psarch.theory.simulate import simulate

    n, phi, rate = 4, 1e6, 1e9
    ratio = {"topk_ratio": RATIO} if compression == "topk" else {}
    cfg = from_dict({"train": {"compression": compression, **ratio},
                     "backend": ps(n, "geo", 1, k_steps=1, geo_barrier=True)})
    expected = predict(cfg, phi)
    assert expected.link.sent == expected.link.received == (RATIO * phi * 12 if compression == "topk" else 2 * phi)
    p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), False)
    assert simulate(p, Cluster.of(p, rate)).step_s == pytest.approx(n * 2 * expected.link.sent / rate)


def test_workers_of_a_barrier_share_one_copy_and_each_rounds_delta():
    """GEO with the barrier: every worker pulls round r's model at version r from the same start-up pull, so the
    server keeps one copy and sends each worker the same delta, computed once per version (the copy moved once)."""
    from psarch.ps.server.deltas import WorkerCopies
    torch.manual_seed(2)
    params = torch.randn(300)
    shared, apart = (WorkerCopies(params, 3, torch.float32, RATIO, shared=s) for s in (True, False))
    assert (shared.nbytes, apart.nbytes) == (4 * 300, 3 * 4 * 300)
    for version in range(1, 4):
        params += 0.1 * torch.randn(300)
        first = shared.delta(0, params, version)
        for w in range(3):
            keys, values = shared.delta(w, params, version)
            assert keys is first[0] and values is first[1]   # the same pairs, not selected again
            alone = apart.delta(w, params, version)
            assert torch.equal(keys, alone[0]) and torch.equal(values, alone[1])
            assert torch.equal(shared.held(w), apart.held(w))


def test_only_a_checkpoint_of_the_same_compression_is_restored_exactly_into_compressed_pulls():
    """The servers' copies of what each worker holds are in a compressed GEO run's checkpoints (tests/
    test_ps_compression_checkpoint.py), not in an uncompressed one's: a checkpoint of GEO without compression (or
    with another) forks into compressed pulls, where every worker pulls whole, which sets the copies. Restored
    exactly, the copies stayed at the initial model and every later pull sent the whole way from it on top of the
    checkpoint's model (0.117 apart after one round, found in review)."""
    from psarch.ps.snapshot import exact_records, run_shape

    class Written:   # a checkpoint's state as a GEO run of `cfg`'s shape wrote it
        def __init__(self, cfg, numel):
            self.state = {"ps": {"run": run_shape(cfg, numel), "servers": [], "workers": []}}

    plain, topk, fp16 = (from_dict(config("x", train=dict(SGD, **t), backend=ps(N, "geo", SERVERS)))
                         for t in ({}, {"compression": "topk", "topk_ratio": 1.0}, {"compression": "fp16"}))
    assert exact_records(Written(plain, 100), plain, 100) is not None
    assert exact_records(Written(plain, 100), topk, 100) is None   # no copies in it: a fork
    assert exact_records(Written(fp16, 100), topk, 100) is None
    assert exact_records(Written(topk, 100), topk, 100) is not None   # its copies are in it


def test_a_whole_pull_after_a_delta_is_refused_where_the_copy_is_shared():
    """Under the barrier one copy stands for every worker: a worker's whole pull mid-run would reset it to the
    parameters, and what the other workers' deltas left out would never be sent (review: 0.032 apart after 28
    rounds). It is refused in one line; the start-up's whole pulls are not."""
    import zmq
    from psarch.ps import wire
    from psarch.ps.services import start_services
    from psarch.workload import build_workload
    from ps_setup import Raw
    cfg = from_dict(config("srv", train={"optimizer": "sgd", "lr": 0.5, "compression": "topk", "topk_ratio": RATIO},
                           workload={"model": "mlp"}, backend=ps(2, "geo", 1, geo_barrier=True, k_steps=1)))
    numel = sum(p.numel() for p in build_workload(cfg).model.parameters())
    k = math.ceil(RATIO * numel)
    services, zctx = start_services(cfg, None, threads=True), zmq.Context()
    try:
        raws = [Raw(zctx, services.info.addresses[0], services.info.auth, w) for w in range(2)]
        for w, raw in enumerate(raws):
            assert raw.ask({"op": "pull", "worker": w, "step": 0, "want": "float32"}).op == "params"
        for w, raw in enumerate(raws):   # round 0: both push their pairs, then both hear the round's delta
            raw.sock.send_multipart(wire.encode({"op": "sparsepushpulldelta", "worker": w, "step": 0, "version": 0,
                                                 "offset": 0}, 0.05 * torch.randn(k, 1), torch.randperm(numel)[:k]))
        assert [raw.reply().op for raw in raws] == ["sparsedelta"] * 2
        r = raws[1].ask({"op": "pull", "worker": 1, "step": 1, "want": "float32"})
        assert r.op == "error" and "whole" in r.header["message"] and "pull deltas" in r.header["message"], r.header
    finally:
        services.stop()
        zctx.destroy(linger=0)


def test_a_malformed_delta_reply_is_one_clear_error_and_changes_nothing():
    """A sparse delta whose keys and values do not pair up, or whose keys are not int64, is refused before it is
    added to what the worker holds."""
    from types import SimpleNamespace

    from psarch.ps.errors import PSError
    from psarch.ps.worker.link import ServerLink
    link = SimpleNamespace(synced=torch.zeros(10), client=SimpleNamespace(worker=0))
    part = SimpleNamespace(lo=0, hi=10)
    for keys, values in ((torch.tensor([1, 2, 3]), torch.ones(2)), (torch.tensor([1, 2], dtype=torch.int32),
                                                                  torch.ones(2)), (None, torch.ones(9))):
        with pytest.raises(PSError, match=r"^worker 0: partition \[0, 10\): a delta of "):
            ServerLink._add_delta(link, part, SimpleNamespace(received=values, reply_keys=keys))
        assert not link.synced.any()
