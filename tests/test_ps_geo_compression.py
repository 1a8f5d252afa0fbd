"""GEO with gradient compression (`backend.mode = "geo"`, `train.compression`): a worker pushes its delta
compressed (top-k with error feedback, or cast to 2 bytes) and pulls each partition's compressed change since the
model it holds (psarch/ps/server/deltas.py: the server keeps what each worker holds, so what a pull leaves out
goes with the next).

Runs: 2 workers, 2 servers, the tiny GPT, SGD with momentum, GEO with the barrier (deterministic: every worker
pulls each round's model) and k_steps = 2, 8 steps (4 rounds); one without the barrier; one longer top-k run.
Tolerances:
- top-k of every element equals uncompressed GEO within SGD's 1e-5: the pushed pairs sum as the dense deltas do
  (bit for bit, tests/test_compression.py), but a pull adds params - copy to the copy, and copy + (params - copy)
  can be one rounding off params where the subtraction rounds (carried to the next pull, not accumulated);
  measured: 0.0, bitwise (params - copy is exact where the two are within a factor 2, Sterbenz's lemma, as they
  are from round to round);
- fp16/bf16: each push rounded once per element per round (no error feedback on a cast), each pull's rounding
  carried to the next: within 2 roundings a round of the largest movement of any parameter
  (test_casts_stay_within_their_roundings);
- top-k at 0.1 ends more than 100x the tolerance from uncompressed GEO: the compression is real.
Bytes: a header frame per request and reply is at most HEADER_BOUND (tests/test_ps.py's); payloads, counted with
the header frames left out, equal the formula exactly, per step (test_payload_bytes_per_step_equal_the_formula_
exactly) and per message (test_a_compressed_pull_carries_the_formulas_bytes).
"""
from __future__ import annotations

import math

import pytest
import torch

from parity import SGD_ATOL, assert_same_model, config, model, train
from psarch.config import from_dict
from ps_setup import ps, run_with_stats

HEADER_BOUND = 128
SGD = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "steps": 8}
K_STEPS, RATIO, N, SERVERS = 2, 0.1, 2, 2
ROUNDS = SGD["steps"] // K_STEPS
VARIANTS = {   # name -> (train, backend extra)
    "geo-none": ({}, {}),
    "geo-topk-all": ({"compression": "topk", "topk_ratio": 1.0}, {}),
    "geo-topk": ({"compression": "topk", "topk_ratio": RATIO}, {}),
    "geo-topk-parts": ({"compression": "topk", "topk_ratio": RATIO}, {"partition_mb": 0.001}),
    "geo-fp16": ({"compression": "fp16"}, {}),
    "geo-bf16": ({"compression": "bf16"}, {}),
    "geo-topk-async": ({"compression": "topk", "topk_ratio": RATIO}, {"geo_barrier": False}),
    # bf16 compute: the pairs' values (both ways) and the error feedback in bf16, the copies fp32
    "geo-topk-bf16": ({"compression": "topk", "topk_ratio": RATIO, "precision": "bf16"}, {}),
    "geo-topk-long": ({"compression": "topk", "topk_ratio": RATIO, "steps": 40}, {}),
}


def data(name: str) -> dict:
    train_, extra = VARIANTS[name]
    backend = ps(N, "geo", SERVERS, **{"k_steps": K_STEPS, "geo_barrier": True, **extra})
    return config(name, train={**SGD, **train_}, backend=backend)


def every_variant(rank: int, n: int, out: str, infos: dict) -> dict:
    return {name: train(rank, n, data(name), infos[name], out) for name in VARIANTS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from psarch.ps.services import start_services
    out = tmp_path_factory.mktemp("geo-compression")
    services = {name: start_services(from_dict(data(name)), None, threads=True) for name in VARIANTS}
    res, stats = run_with_stats(out, services, every_variant, N)
    return out, res, stats


def largest_difference(a: dict, b: dict) -> float:
    return max((a[k] - v).abs().max().item() for k, v in b.items())


def test_top_k_of_everything_is_uncompressed_geo(runs):
    out, _, _ = runs
    ref = model(out, "geo-none")
    print("geo top-k 1.0 vs geo:", largest_difference(model(out, "geo-topk-all"), ref))
    assert_same_model(model(out, "geo-topk-all"), ref, "geo top-k of everything vs geo", rtol=0, atol=SGD_ATOL)
    for name in ("geo-topk", "geo-topk-parts"):
        far = largest_difference(model(out, name), ref)
        print(f"{name} vs geo: {far:.3g}")
        assert far > 100 * SGD_ATOL, f"{name}: {far:g} from uncompressed geo"


def test_casts_stay_within_their_roundings(runs):
    """fp16/bf16 both ways: within 2 roundings a round of the largest movement of a parameter, yet not the
    uncompressed model (the casts are real)."""
    from psarch.workload import build_workload
    out, _, _ = runs
    ref = model(out, "geo-none")
    start = dict(build_workload(from_dict(data("geo-none"))).model.named_parameters())
    moved = max((ref[k] - p.detach()).abs().max().item() for k, p in start.items())
    for name, unit_roundoff in (("geo-fp16", 2.0**-11), ("geo-bf16", 2.0**-8)):
        diff = largest_difference(model(out, name), ref)
        bound = 2 * ROUNDS * unit_roundoff * moved
        print(f"{name} vs geo: {diff:.3g} (bound {bound:.3g})")
        assert 0 < diff <= bound, name


def test_a_compressed_geo_run_learns(runs):
    _, res, _ = runs
    for r in res:
        losses = [row["loss"] for row in r["geo-topk-long"]["rows"]]
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        print(f"geo top-k {RATIO}: mean loss of the first 5 steps {first:.4f}, of the last 5 {last:.4f}")
        assert last < first - 0.1


def sizes(name: str, phi: int) -> list[int]:
    from psarch.ps.layout import server_partitions
    return [hi - lo for parts in server_partitions(from_dict(data(name)), phi) for lo, hi in parts]


def formula(name: str, phi: int) -> tuple[int, int]:
    """(bytes a worker pushes, bytes it pulls) per round, payloads only: top-k k = ceil(ratio x partition) pairs of
    an int64 index and a value (4 bytes; bf16 compute 2) each way; a cast 2 bytes an element each way; else 4 bytes
    an element."""
    train_ = VARIANTS[name][0]
    parts = sizes(name, phi)
    if train_.get("compression") == "topk":
        value = 2 if train_.get("precision") == "bf16" else 4
        pairs = sum(math.ceil(train_["topk_ratio"] * size) * (8 + value) for size in parts)
        return pairs, pairs
    width = 2 if train_.get("compression") in ("fp16", "bf16") else 4
    return width * phi, width * phi


@pytest.mark.parametrize("name", ["geo-topk", "geo-topk-parts", "geo-topk-async", "geo-topk-bf16", "geo-fp16",
                                  "geo-bf16", "geo-topk-all", "geo-none"])
def test_bytes_per_round_equal_the_formula(runs, name):
    """Every round a worker sends the formula's bytes (+ a header per request) and receives the formula's (+ a
    header per reply), nothing between rounds; the servers receive what the workers send; theory predicts both."""
    from psarch.theory import predict
    _, res, stats = runs
    phi = res[0][name]["params"]
    up, down = formula(name, phi)
    headers = len(sizes(name, phi)) * HEADER_BOUND
    for r in res:
        rows = r[name]["rows"]
        assert [row["sent"] > 0 for row in rows] == [False, True] * ROUNDS, name
        for row in rows[K_STEPS - 1::K_STEPS]:
            assert up < row["sent"] <= up + headers, (name, row["sent"], up)
            assert down < row["received"] <= down + headers, (name, row["received"], down)
    p = predict(from_dict(data(name)), phi)
    assert (p.link.sent, p.link.received) == (up / K_STEPS, down / K_STEPS), name
    print(f"{name}: per round {up} B pushed, {down} B pulled (payload; Φ = {phi}, {len(sizes(name, phi))} partitions)")


EXACT = ("geo-topk-parts", "geo-topk-async", "geo-topk-bf16", "geo-fp16")


def payload_only(rank: int, n: int, out: str, infos: dict) -> dict:
    """Runs whose workers count each message's payload alone: in this rank process (its own, spawned) the meter's
    frames_bytes leaves out the header frame, so each row's bytes are the tensors' and keys' bytes on the wire."""
    from psarch.ps import wire
    wire.frames_bytes = lambda frames: sum(len(memoryview(f)) for f in frames[1:])
    return {name: train(rank, n, data(name), infos[name], out) for name in EXACT}


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    from psarch.ps.services import start_services
    out = tmp_path_factory.mktemp("geo-compression-payloads")
    services = {name: start_services(from_dict(data(name)), None, threads=True) for name in EXACT}
    return run_with_stats(out, services, payload_only, N)[0]


@pytest.mark.parametrize("name", EXACT)
def test_payload_bytes_per_step_equal_the_formula_exactly(payloads, name):
    """Counted where they are sent and received, headers left out: every round's bytes are the formula's to the
    byte, each way (top-k: k (8 + value bytes) per partition; a cast: 2 Φ), nothing between rounds."""
    phi = payloads[0][name]["params"]
    up, down = formula(name, phi)
    for r in payloads:
        rows = r[name]["rows"]
        assert [row["sent"] for row in rows] == [0, up] * ROUNDS, name
        assert [row["received"] for row in rows] == [0, down] * ROUNDS, name


@pytest.mark.parametrize("name", ["geo-topk", "geo-topk-async", "geo-topk-bf16", "geo-fp16", "geo-none"])
def test_memory_equals_the_formula(runs, name):
    """A worker keeps its last synced model (4Φ) and, with top-k, the error of every element it pushes (in the
    compute dtype: 4Φ, bf16 2Φ); a
    server keeps, with compressed pulls, each worker's copy of its range (4 N x held; with the barrier, where all
    workers hold the same model, one: 4 x held, and the round's delta, kept for every worker's pull: its wire
    bytes), beside the barrier's accumulator (4 x held); theory predicts both."""
    from psarch.ps.theory import dense_partitions, pulled_bytes
    from psarch.theory import predict
    _, res, stats = runs
    phi = res[0][name]["params"]
    compression = VARIANTS[name][0].get("compression", "none")
    barrier = VARIANTS[name][1].get("geo_barrier", True)
    width = 2 if VARIANTS[name][0].get("precision") == "bf16" else 4
    error = width * phi if compression == "topk" else 0
    for r in res:
        m = r[name]["memory"]
        assert (m["error_feedback"], m["buffers"]) == (error, 4 * phi + error), name   # + the fp32 synced copy
    copies = (1 if barrier else N) if compression != "none" else 0
    servers = stats[name]["memory"]["servers"]
    cfg = from_dict(data(name))
    kept = [sum(pulled_bytes(cfg, hi - lo) for lo, hi in parts) if barrier and compression != "none" else 0
            for parts in dense_partitions(cfg, phi)]
    assert len(kept) == len(servers) == SERVERS
    for m, delta in zip(servers, kept):
        assert m["buffers"] == 4 * m["held"] * (copies + barrier) + delta, name
    p = predict(cfg, phi)
    assert p.memory_per_rank.buffers == 4 * phi + error, name
    assert SERVERS * p.nodes["server"].memory.total == sum(m["total"] for m in servers), name
    print(f"{name}: server buffers {[m['buffers'] for m in servers]} B, held {[m['held'] for m in servers]}")


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
