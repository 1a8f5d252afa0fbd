"""Gradient compression beside embedding tables that move apart from the dense buckets (train.compression with
backend.embeddings = "rows", "sharded" or "ps": collective/embeddings.py keeps the tables out of ddp's buckets,
ZeRO's hybrid out of its reduce-scatters), on dlrm/clicks at N = 2, the hybrid's tables on 2 PS servers, SGD, 4 steps,
one thread per rank. The dense layers' buckets are compressed as without tables; the rows move whole.

Tolerances: the treatments move the same dense buckets (the dense layers in one bucket, in the same order) and sum
the same rows' gradients in fp32, so a compression beside one treatment equals it beside another within SGD's 1e-5
(ddp rows against the hybrid and sharded; ZeRO-2's fp16 reduce-scatter against ddp's fp16 all-reduce, at N = 2 the
same sum of two 2-byte values). fp16 against the uncompressed hybrid: each step's averaged gradient rounded twice
(the cast of g/N, the sum) at fp16's 2^-11, |g| < 1 here, over 4 SGD steps at lr 0.5: within FP16_ATOL = 4 x 0.5 x 2
x 2^-11 ~ 2e-3, and not equal (the cast is applied)."""
from __future__ import annotations

import functools
import math

import pytest

from parity import SGD_ATOL, assert_same_model, config, model, run_plan
from psarch.config import ConfigError, from_dict
from psarch.embeddings import embedding_tables
from psarch.ps import theory as ps_theory
from psarch.workload import build_workload
from test_compression import plan as powersgd_by_hand
from test_ps_rows import OPTIMIZERS, ROWS_DLRM as DLRM

N, SERVERS, RATIO, RANK, WARMUP = 2, 2, 0.25, 1, 1
STEPS, LR = DLRM["train"]["steps"], OPTIMIZERS["sgd"]["lr"]
FP16_ATOL = STEPS * LR * 2 * 2.0**-11
COMPRESSIONS = {"none": {}, "fp16": {"compression": "fp16"}, "topk": {"compression": "topk", "topk_ratio": RATIO},
                "powersgd": {"compression": "powersgd", "powersgd_rank": RANK, "powersgd_warmup_steps": WARMUP}}
HYBRID = {"kind": "ddp", "embeddings": "ps", "servers": SERVERS}
TREATMENTS = {"hybrid": HYBRID, "rows": {"kind": "ddp", "embeddings": "rows"}}
RUNS = {**{f"{t}-{c}": (b, c) for t, b in TREATMENTS.items() for c in COMPRESSIONS},
        "sharded-topk": ({"kind": "ddp", "embeddings": "sharded"}, "topk"),
        "zero2-hybrid-fp16": ({"kind": "zero", "stage": 2, "embeddings": "ps", "servers": SERVERS}, "fp16")}


def _data(name: str) -> dict:
    backend, c = RUNS[name]
    return config(name, base=DLRM, train={**OPTIMIZERS["sgd"], **COMPRESSIONS[c]}, backend={**backend, "world_size": N})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression_embeddings")
    return out, run_plan({name: _data(name) for name in RUNS}, {name for name in RUNS if "hybrid" in name}, N, out)


@functools.cache
def dense_shapes() -> tuple[tuple[int, ...], ...]:
    """The dense layers' parameter shapes in ddp's bucket order (reversed), the tables left out (built once: the
    byte checks ask it for every rank, step and direction)."""
    m = build_workload(from_dict(config("x", base=DLRM)), device="meta").model
    tables = {id(t.weight) for _, t in embedding_tables(m)}
    return tuple(tuple(p.shape) for p in m.parameters() if id(p) not in tables)[::-1]


def ring(numel: int, itemsize: int = 4) -> int:
    return 2 * (N - 1) * -(-numel // N) * itemsize if numel else 0


def plan() -> tuple[int, list[tuple[int, int, int]]]:
    """PowerSGD's plan of the dense layers, by hand from its rule (test_compression.plan)."""
    return powersgd_by_hand(RANK, dense_shapes())


def dense_bytes(compression: str, step: int) -> int:
    """What a rank sends (= receives) averaging the dense layers' one bucket at step `step`."""
    d = sum(math.prod(s) for s in dense_shapes())
    if compression == "fp16":
        return ring(d, 2)
    if compression == "topk":   # the all-gather of k (int32 index, fp32 value) pairs
        return (N - 1) * math.ceil(RATIO * d) * (4 + 4)
    if compression == "powersgd" and step >= WARMUP:
        whole, factored = plan()
        return ring(whole) + ring(sum(n * r for n, _, r in factored)) + ring(sum(m * r for _, m, r in factored))
    return ring(d)


def error_feedback(compression: str) -> int:
    """top-k: one fp32 error per dense element; PowerSGD: that and P and Q, (n + m) r per factored matrix."""
    d = sum(math.prod(s) for s in dense_shapes())
    extra = sum((n + m) * r for n, m, r in plan()[1]) if compression == "powersgd" else 0
    return 4 * (d + extra) if compression in ("topk", "powersgd") else 0


def test_a_compression_beside_one_treatment_equals_it_beside_another(runs):
    """The hybrid equals ddp rows under every compression, sharded equals rows under top-k, ZeRO-2's hybrid ddp's
    under fp16 (SGD's 1e-5); the lossy ones are far from uncompressed (so the parity is not vacuous); fp16 within
    FP16_ATOL of the uncompressed hybrid and not equal to it."""
    out, _ = runs
    for c in COMPRESSIONS:
        assert_same_model(model(out, f"hybrid-{c}"), model(out, f"rows-{c}"), f"hybrid vs rows, {c}", rtol=0,
                          atol=SGD_ATOL)
    assert_same_model(model(out, "sharded-topk"), model(out, "rows-topk"), "sharded vs rows, topk", rtol=0,
                      atol=SGD_ATOL)
    assert_same_model(model(out, "zero2-hybrid-fp16"), model(out, "hybrid-fp16"), "zero-2 vs ddp hybrid, fp16",
                      rtol=0, atol=SGD_ATOL)
    none = model(out, "hybrid-none")
    for c in ("topk", "powersgd", "fp16"):
        far = max((model(out, f"hybrid-{c}")[k] - v).abs().max().item() for k, v in none.items())
        print(f"hybrid {c}: largest difference from the uncompressed hybrid {far:.3g}")
        assert far > (100 * SGD_ATOL if c != "fp16" else 0), c
    assert_same_model(model(out, "hybrid-fp16"), none, "hybrid fp16 vs uncompressed", rtol=0, atol=FP16_ATOL)


@pytest.mark.parametrize("treatment", list(TREATMENTS))
@pytest.mark.parametrize("compression", ["fp16", "topk", "powersgd"])
def test_bytes_per_step_are_the_compressed_bucket_plus_the_rows_as_uncompressed(runs, treatment, compression):
    """Each rank's each step: what the compressed run sent and received, less the dense bucket's formula, is what
    the uncompressed run of the same treatment sent and received less its ring all-reduce: the rows (and the PS's
    headers) as they move without compression, to the byte."""
    _, results = runs
    for rank in range(N):
        got = results[f"{treatment}-{compression}"][rank]["rows"]
        ref = results[f"{treatment}-none"][rank]["rows"]
        for step, (a, b) in enumerate(zip(got, ref)):
            assert a["extra"]["unique_ids"] == b["extra"]["unique_ids"]
            for way in ("sent", "received"):
                assert a[way] - dense_bytes(compression, step) == b[way] - dense_bytes("none", step), \
                    (treatment, compression, rank, step, way)
        ops = results[f"{treatment}-{compression}"][rank]["traffic"]["ops"]
        if treatment == "hybrid":   # the communicator's ops carry the dense bucket alone
            op = "all_gather" if compression == "topk" else "all_reduce"
            assert ops[op]["sent"] == ops[op]["received"] == sum(dense_bytes(compression, s) for s in range(STEPS))


@pytest.mark.parametrize("name", ["hybrid-topk", "hybrid-powersgd", "rows-topk", "rows-powersgd", "sharded-topk",
                                  "hybrid-fp16", "zero2-hybrid-fp16"])
def test_error_feedback_memory_is_the_dense_layers_alone(runs, name):
    _, results = runs
    for r in results[name]:
        assert r["memory"]["error_feedback"] == error_feedback(RUNS[name][1]), name


@pytest.mark.parametrize("name", ["hybrid-fp16", "hybrid-topk", "hybrid-powersgd", "rows-topk", "rows-powersgd",
                                  "zero2-hybrid-fp16"])
def test_theory_predicts_the_compressed_bucket_plus_the_rows(runs, name):
    """predict: the compressed bucket's bytes (the run's mean: PowerSGD's warm-up step whole), plus the rows as the
    treatment moves them at E[u] (the hybrid: rows_traffic; rows: three all-gathers); its dense part equals the
    counted bytes (the run's less the uncompressed run's rows, as above); its buffers the error feedback."""
    from collective.theory import rows_link
    from psarch.theory import expected_unique_ids, predict

    _, results = runs
    cfg = from_dict(_data(name))
    c, r = RUNS[name][1], results[name][0]
    p = predict(cfg, r["params"])
    u, dim = expected_unique_ids(cfg), cfg.workload.dlrm.dim
    rows = ps_theory.rows_traffic(u, dim, 0, 4) if "hybrid" in name else rows_link(cfg)[0]
    mean = sum(dense_bytes(c, s) for s in range(STEPS)) / STEPS
    if name.startswith("zero"):   # ZeRO-2: the fp16 reduce-scatter and the fp32 all-gather, as measured
        ops = r["traffic"]["ops"]
        mean = (ops["reduce_scatter"]["sent"] + ops["all_gather"]["sent"]) / STEPS
    # ZeRO pads its reduce-scatter and all-gather to a multiple of N (217 elements to 218 here), which predict does
    # not count: at most N - 1 elements of each, in 2 and 4 bytes
    pad = (N - 1) * (2 + 4) if name.startswith("zero") else 0
    assert p.link.sent == pytest.approx(mean + rows.sent, rel=1e-12, abs=pad), name
    assert p.link.received == pytest.approx(mean + rows.received, rel=1e-12, abs=pad), name
    assert p.memory_per_rank.buffers == r["memory"]["error_feedback"] == error_feedback(c), name
    if not name.startswith("zero"):
        treatment = name.split("-")[0]
        counted = [a["sent"] - b["sent"] + ring(sum(math.prod(s) for s in dense_shapes()))
                   for a, b in zip(r["rows"], results[f"{treatment}-none"][0]["rows"])]
        assert p.link.sent - rows.sent == pytest.approx(sum(counted) / STEPS, rel=1e-12), name
    print(f"{name}: predicted {p.link.sent:.1f} B/step sent (dense {mean:.1f} + rows {rows.sent:.1f} at E[u] = "
          f"{u:.2f}); measured {sum(x['sent'] for x in r['rows']) / STEPS:.1f}")


@pytest.mark.parametrize("backend, train_, words", [
    ({"kind": "torch_ddp", "embeddings": "rows"}, {"compression": "fp16"}, "tables' sparse gradients in its buckets"),
    ({"kind": "torch_ddp", "embeddings": "rows"}, {"compression": "powersgd", "powersgd_warmup_steps": 2},
     "tables' sparse gradients in its buckets"),
    ({"kind": "zero", "embeddings": "ps", "servers": SERVERS}, {"compression": "topk"}, "ZeRO reduce-scatters"),
])
def test_the_combinations_that_remain_are_refused_in_one_line(backend, train_, words):
    data = config("x", base=DLRM, train={**OPTIMIZERS["sgd"], **train_}, backend={**backend, "world_size": N})
    with pytest.raises(ConfigError) as e:
        from_dict(data)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_hybrid_checkpoints_its_error_feedback():
    """ddp writes its compression's state into its checkpoints whatever the tables (collective/ddp.py): the
    hybrid with top-k takes train.checkpoint_every, which a backend without that state refuses."""
    data = config("x", base=DLRM, train={**OPTIMIZERS["sgd"], **COMPRESSIONS["topk"], "checkpoint_every": 2},
                  backend={**HYBRID, "world_size": N})
    assert from_dict(data).train.checkpoint_every == 2
