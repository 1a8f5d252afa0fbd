"""GEO with gradient compression (`backend.mode = "geo"`, `train.compression`): a worker pushes its delta
compressed (top-k with error feedback, or cast to 2 bytes) and pulls each partition's compressed change since the
model it holds (psarch/ps/server/deltas.py: the server keeps what each worker holds, so what a pull leaves out
goes with the next).

Runs: 2 workers, 2 servers, the tiny GPT, SGD with momentum, GEO with the barrier (deterministic: every worker
pulls each round's model) and k_steps = 2, 8 steps (4 rounds); one without the barrier; one longer top-k run.
Tolerances:
- top-k of every element equals uncompressed GEO within SGD's 1e-5: the pushed pairs sum as the dense deltas do
  (bit for bit, tests/test_ps_compression.py), but a pull adds params - copy to the copy, and copy + (params - copy)
  can be one rounding off params where the subtraction rounds (carried to the next pull, not accumulated);
  measured: 0.0, bitwise (params - copy is exact where the two are within a factor 2, Sterbenz's lemma, as they
  are from round to round);
- fp16/bf16: each push rounded once per element per round (no error feedback on a cast), each pull's rounding
  carried to the next: within 2 roundings a round of the largest movement of any parameter
  (test_casts_stay_within_their_roundings);
- top-k at 0.1 ends more than 100x the tolerance from uncompressed GEO: the compression is real.
Bytes: a header frame per request and reply is at most HEADER_BOUND (tests/test_ps.py's); payloads, counted with
the header frames left out, equal the formula exactly, per step (test_payload_bytes_per_step_equal_the_formula_
exactly) and per message (tests/test_ps_geo_deltas.py's test_a_compressed_pull_carries_the_formulas_bytes).
The servers' copies, their deltas and the refusals on the wire, without a run: tests/test_ps_geo_deltas.py.
"""
from __future__ import annotations

import math

import pytest

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
