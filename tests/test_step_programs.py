"""Each backend's step program (collective/program.py, zero/program.py, psarch/ps/program.py) simulated in full
(every rank and server its own node and ops) and by its reduction (one node standing for alike ones) agrees
within 1% at every N from 2 to 32, with latency, compute and overlap in play; and the programs a spec writes
from a config time what their formulas say."""
from __future__ import annotations

import math

import pytest

from collective.program import ALL_TO_ALL, TableServers, bucketed, collectives, ddp_program
from psarch import registry
from psarch.config import from_dict
from psarch.dp.program import dp_program
from psarch.ps.program import CommitBytes, RowBytes, Slot, groups_of, held_slots, ps_program, ps_reduced
from psarch.theory.program import Cluster, DataStep, chunks
from psarch.theory.simulate import simulate
from zero.program import sharded, stage12_program, stage3_program, zero3_script

RATE, ALPHA = 1e9, 2e-5
STEP = DataStep.of(0.05)
S = 40e6          # bytes of gradients
UNITS = [S / 10] + [0.225 * S] * 4   # ZeRO-3's root and 4 blocks
SLOTS = [Slot(S / 8 / 4, (i + 1) / 4) for i in range(4)]   # a server's 4 partitions, ready through backward


def ps(k: int | str, colocated: bool = False, uneven: bool = False, barrier: bool = True, local_steps: int = 1,
       rows: bool = False, replicas: int = 0):
    """The PS with k servers of SLOTS each (uneven: every other one a partition short, as round robin deals);
    barrier = False: async; local_steps: GEO's; rows: embedding rows pulled before forward, pushed after backward;
    replicas: each server's slots held by the next r servers too (chain replication)."""
    def write(n: int, reduced: bool):
        count = n if k == "n" else (max(1, n // 2) if k == "n/2" else int(k))
        servers = [SLOTS[:3] if uneven and j % 2 else SLOTS for j in range(count)]
        servers = held_slots(servers, replicas) if replicas else servers
        rb = RowBytes(8e3 / count, S / 16 / count, S / 16 / count) if rows else None
        cb = CommitBytes(50.0, 17.0) if replicas else None
        if reduced:
            return ps_reduced(n, groups_of(servers), colocated, STEP, barrier, local_steps, rb, cb)
        return ps_program(n, servers, colocated, STEP, barrier, local_steps, rb, cb)
    return write


def compressed_ddp(later: bool):
    """4 buckets, each: a top-k all-gather (1 pass over n pairs' worth), or PowerSGD's whole and P all-reduced as
    it fills and its Q after backward (later) or right after P (torch's hook)."""
    def write(n: int, reduced: bool):
        sizes = chunks(S, S / 4)
        if not later:
            launched = [[(f"tk{b}", n * size / 50, 1)] for b, size in enumerate(sizes)]
            return collectives(n, sizes, launched, [], STEP, True, reduced)[0]
        launched = [[(f"w{b}", size / 20, 2), (f"p{b}", size / 10, 2)] for b, size in enumerate(sizes)]
        return collectives(n, sizes, launched, [(f"q{b}", size / 10, 2) for b, size in enumerate(sizes)], STEP,
                           True, reduced)[0]
    return write


def ps_compressed(n: int, reduced: bool):
    """The PS with n servers whose pushes carry a tenth of the pulls' bytes (top-k)."""
    servers = [[Slot(x.bytes, x.ready, x.bytes / 10) for x in SLOTS] for _ in range(n)]
    return ps_reduced(n, groups_of(servers), False, STEP) if reduced else ps_program(n, servers, False, STEP)


def embedding_rows(sharded: bool):
    """Dense buckets all-reduced from backward's hooks and embedding rows beside them: all-gathered after backward,
    or (sharded) all-to-all before forward and after backward."""
    def write(n: int, reduced: bool):
        sizes = chunks(S / 4, S / 16)
        dense = [[(f"ar{b}", size, 2)] for b, size in enumerate(sizes)]
        if sharded:
            before = [("counts", 24.0 * (n - 1), ALL_TO_ALL), ("ids", 8e4, ALL_TO_ALL), ("rows", S / 8, ALL_TO_ALL)]
            return collectives(n, sizes, dense, [("grads", S / 8, ALL_TO_ALL)], STEP, True, reduced, before)[0]
        later = [("counts", n * 24.0, 1), ("ids", n * 8e4, 1), ("rows", n * S / 8, 1)]
        return collectives(n, sizes, dense, later, STEP, True, reduced)[0]
    return write


def hybrid(dense: str, k: int | str, colocated: bool = False):
    """The hybrid: `dense` ("ddp", "zero-1/2", "zero-3") over the dense layers, each rank's embedding rows pulled
    from k table servers (dedicated or colocated) before forward and their gradients pushed after backward."""
    def write(n: int, reduced: bool):
        count = n if k == "n" else (max(1, n // 2) if k == "n/2" else int(k))
        tables = TableServers(count, colocated, RowBytes(8e3 / count, S / 16 / count, S / 16 / count))
        sizes = chunks(S / 4, S / 16)
        if dense == "ddp":
            return bucketed(n, sizes, STEP, True, reduced, "ar", 2, tables)[0]
        if dense == "zero-1/2":
            return stage12_program(n, sizes, chunks(S / 4, S / 8), STEP, True, reduced, tables=tables)
        return sharded(n, zero3_script([u / 4 for u in UNITS], STEP, 0.05 * S, True, 2), reduced, tables=tables)
    return write


PROGRAMS = {
    "ddp, embedding rows all-gathered": embedding_rows(False),
    "ddp, embedding rows sharded (all-to-all)": embedding_rows(True),
    "ddp, top-k all-gather": compressed_ddp(False),
    "ddp, PowerSGD": compressed_ddp(True),
    "ps, n servers, compressed pushes": ps_compressed,
    "ddp, overlap": lambda n, r: ddp_program(n, chunks(S, S / 4), STEP, True, r),
    "ddp, after backward": lambda n, r: ddp_program(n, chunks(S, S / 3), STEP, False, r),
    "zero-1/2": lambda n, r: stage12_program(n, chunks(S, S / 3), chunks(S, S / 2), STEP, True, r),
    "zero-3": lambda n, r: stage3_program(n, [S / 3] * 3, STEP, r),
    "zero-3, FSDP2's prefetch and root": lambda n, r: stage3_program(n, [S / 6, S / 3, S / 3, S / 6], STEP, r,
                                                                     prefetch=1, keep_first=True),
    "zero-3, the trainer's units, prefetch of one": lambda n, r: sharded(n, zero3_script(UNITS, STEP, 0.2 * S, True, 2),
                                                                         r),
    "zero-3, the trainer's units, all prefetched": lambda n, r: sharded(n, zero3_script(UNITS, STEP, S, True, 2), r),
    "zero-3, the trainer's units, no prefetch, blocking": lambda n, r: sharded(n, zero3_script(UNITS, STEP, 0, False, 2),
                                                                               r),
    "dp, copies to and from the master": lambda n, r: dp_program(n, S, STEP, r),
    "torch_zero": lambda n, r: stage12_program(n, chunks(S, S / 3), [S], STEP, True, r, reduce_passes=2),
    "ps, 1 server": ps(1),
    "ps, 2 servers": ps(2),
    "ps, n servers": ps("n"),
    "ps, n colocated": ps("n", colocated=True),
    "ps, n/2 colocated": ps("n/2", colocated=True),
    "ps, n servers, uneven": ps("n", uneven=True),
    "ps, n colocated, uneven": ps("n", colocated=True, uneven=True),
    "ps async, 2 servers": ps(2, barrier=False),
    "ps, embedding rows, 2 servers": ps(2, rows=True),
    "ps, embedding rows, n/2 colocated, uneven": ps("n/2", colocated=True, uneven=True, rows=True),
    "ps async, n/2 colocated, uneven": ps("n/2", colocated=True, uneven=True, barrier=False),
    "ps geo, k = 3, n servers": ps("n", local_steps=3),
    "ps geo without barrier, k = 3, n colocated": ps("n", colocated=True, barrier=False, local_steps=3),
    "ps, n servers, r = 1": ps("n", replicas=1),
    "ps, 3 servers, r = 2, uneven": ps(3, uneven=True, replicas=2),
    "ps, n colocated, r = 1, uneven": ps("n", colocated=True, uneven=True, replicas=1),
    "hybrid ddp, 2 servers": hybrid("ddp", 2),
    "hybrid ddp, n servers": hybrid("ddp", "n"),
    "hybrid ddp, n/2 colocated": hybrid("ddp", "n/2", colocated=True),
    "hybrid ddp, n colocated": hybrid("ddp", "n", colocated=True),
    "hybrid ddp, 1 colocated": hybrid("ddp", 1, colocated=True),
    "hybrid zero-1/2, 2 servers": hybrid("zero-1/2", 2),
    "hybrid zero-1/2, n/2 colocated": hybrid("zero-1/2", "n/2", colocated=True),
    "hybrid zero-3, 2 servers": hybrid("zero-3", 2),
    "hybrid zero-3, n/2 colocated": hybrid("zero-3", "n/2", colocated=True),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_full_and_reduced_agree_within_1_percent(name):
    write = PROGRAMS[name]
    for n in range(2, 33):
        full, reduced = write(n, False), write(n, True)
        a = simulate(full, Cluster.of(full, RATE, ALPHA)).step_s
        b = simulate(reduced, Cluster.of(reduced, RATE, ALPHA)).step_s
        assert b == pytest.approx(a, rel=0.01), f"{name} at N = {n}: full {a:.6g} s, reduced {b:.6g} s"


def test_specs_write_programs_whose_steps_match_the_formulas():
    """From a config, with compute 0 and no latency: the ring moves 2(N-1)/N S per rank, ZeRO-1 the same, ZeRO-3 and
    torch's ZeroRedundancyOptimizer under DDP 3(N-1)/N S, the PS with N dedicated servers S each way at once, pipelined
    over its 16 partitions per server (plus one slot's pull to drain, 1/16 of S), with one server N S through its link
    each way."""
    from psarch import registry, theory

    phi, n, net = 25e6, 8, DataStep(0.0, 0.0)
    s = phi * 4

    def step(kind: str, **backend) -> float:
        cfg = theory.config_for(kind, n, "fp32", "adamw", **backend)
        p = registry.spec_of(cfg).program(cfg, phi, net, True)
        return simulate(p, Cluster.of(p, RATE)).step_s

    assert step("ddp") == pytest.approx(2 * (n - 1) / n * s / RATE)
    assert step("zero", stage=1) == pytest.approx(2 * (n - 1) / n * s / RATE)
    assert step("zero", stage=3) == pytest.approx(3 * (n - 1) / n * s / RATE)
    assert step("torch_zero") == pytest.approx(3 * (n - 1) / n * s / RATE)   # DDP's all-reduce, the broadcasts
    part = s / n / 16      # a range in 16 (rounded down to 64 elements: server 0 gets a 17th, short, a little more)
    assert step("ps", servers=n, partition_mb=part / 2**20) == pytest.approx((s + s / 16) / RATE, rel=3e-3)
    assert step("ps", servers=1, partition_mb=s / 2**20) == pytest.approx(2 * n * s / RATE)


@pytest.mark.parametrize("kind, compression", [("ddp", "fp16"), ("ddp", "bf16"), ("ddp", "topk"), ("ddp", "powersgd"),
                                               ("torch_ddp", "fp16"), ("torch_ddp", "powersgd"),
                                               ("torch_zero", "fp16"), ("torch_zero", "bf16")])
def test_a_compressed_ddp_program_moves_theorys_bytes(kind, compression):
    """With compute 0 and no latency a compressed DDP step is its bytes at the link's rate: the program's
    collectives are theory's (collective/theory.py's bucket_collectives), on ddp's own buckets (several here)."""
    from psarch.theory import predict
    from psarch.workload import build_workload

    n = 4
    warm = {"powersgd_warmup_steps": 2} if compression == "powersgd" else {}
    backend = {"kind": kind, "world_size": n, "bucket_cap_mb": 0.05}
    cfg = from_dict({"train": {"compression": compression, "steps": 10, **warm}, "backend": backend})
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters())
    sent = predict(cfg, phi).link.sent
    if warm:   # the mean over the run holds 2 warm-up steps whole; the median step compresses
        whole = predict(from_dict({"train": {"steps": 10}, "backend": backend}), phi)
        sent = (10 * sent - 2 * whole.link.sent) / 8
    for reduced in (False, True):
        p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), reduced)
        assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(sent / RATE, rel=2e-3)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_zero_program_with_cast_gradients_moves_theorys_bytes(stage):
    """ZeRO with train.compression = "fp16" (zero/wire.py), from a config, with compute 0 and no latency: the step is
    predict's bytes at the link's rate, and predict's bytes are the uncompressed ones less half the reduce-scatter's,
    (N - 1)/N · 2Φ (the reduce-scatters cast to 2 bytes, several buckets in stages 1-2; the all-gathers in fp32)."""
    from psarch.theory import predict

    n, phi = 4, 25e6
    backend = {"kind": "zero", "stage": stage, "world_size": n, "reduce_bucket_size": 10**6,
               "allgather_bucket_size": 3 * 10**6}
    cfg = from_dict({"train": {"compression": "fp16"}, "backend": backend})
    sent = predict(cfg, phi).link.sent
    passes = 3 if stage == 3 else 2
    assert sent == pytest.approx((passes - 0.5) * (n - 1) / n * 4 * phi, rel=1e-12)
    assert predict(from_dict({"backend": backend}), phi).link.sent - sent == pytest.approx((n - 1) / n * 2 * phi)
    for reduced in (False, True):
        p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), reduced)
        assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(sent / RATE, rel=2e-3), reduced


@pytest.mark.parametrize("kind", ["ddp", "torch_ddp"])
def test_a_powersgd_program_pays_alpha_for_each_message_it_sends(kind):
    """With compute 0 and bytes at no cost a compressed PowerSGD step on one bucket is its messages' α: three ring
    all-reduces one after another (the tensors sent whole, every P, every Q), 2(N - 1) messages each, as psarch's
    PowerSGD and torch's hook send them (tests/test_compression.py counts theirs); fp16 one all-reduce. (At 1e15
    bytes/s a transfer's last bytes once took less time than the clock could count, and the simulator stood still.)"""
    from psarch.workload import build_workload

    n, alpha = 4, 1e-3
    for compression, all_reduces in (("powersgd", 3), ("fp16", 1)):
        warm = {"powersgd_warmup_steps": 2} if compression == "powersgd" else {}
        cfg = from_dict({"train": {"compression": compression, "steps": 10, **warm},
                         "backend": {"kind": kind, "world_size": n}})
        phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters())
        for reduced in (False, True):
            p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), reduced)
            step = simulate(p, Cluster.of(p, 1e15, alpha)).step_s
            assert step == pytest.approx(all_reduces * 2 * (n - 1) * alpha, rel=1e-3), (compression, reduced)


def test_a_compressed_ps_program_pushes_theorys_bytes():
    """One server, its range whole: N pushes of top-k pairs in through its link, then N pulls of S out."""
    from psarch.theory import predict

    n, phi = 4, 1e6
    cfg = from_dict({"train": {"compression": "topk", "topk_ratio": 0.1},
                     "backend": {"kind": "ps", "world_size": n, "servers": 1, "partition_mb": 0.0}})
    p, expected = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), False), predict(cfg, phi)
    assert expected.link.sent == pytest.approx(0.1 * phi * 12)
    assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(n * (expected.link.sent + 4 * phi) / RATE)


def test_fsdp_prefetch_hides_a_gather_behind_the_unit_before_and_keeps_the_root():
    """FSDP2's program (torch_fsdp): from a config, with compute 0 and no latency, its passes are forward's
    all-gather of S, backward's of S less the root (kept gathered) and the reduce-scatter of S; with compute, the
    prefetch of one unit makes the step shorter than ZeRO-3's gather-then-compute."""
    from psarch.theory import config_for
    from zero.theory import unit_shares

    n, phi = 4, 25e6
    cfg = config_for("torch_fsdp", n)
    root = unit_shares(cfg)[0]
    assert 0 < root < 1
    p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), False)
    s = 4 * phi
    assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx((3 - root) * (n - 1) / n * s / RATE)
    units = [s / 4] * 4
    slow = stage3_program(n, units, DataStep.of(0.2), False)
    fast = stage3_program(n, units, DataStep.of(0.2), False, prefetch=1)
    assert simulate(fast, Cluster.of(fast, RATE)).step_s < simulate(slow, Cluster.of(slow, RATE)).step_s - 0.05


@pytest.mark.parametrize("kind, options, holds", [("ddp", {}, False), ("zero", {"stage": 3}, True),
                                                  ("torch_fsdp", {}, True)])
def test_a_measured_compute_that_holds_blocking_passes_is_taken_apart_from_them(kind, options, holds):
    """cluster_step's compute from a measured step: where the trainer's measured compute holds waits for collectives
    (BackendSpec.compute_holds_waits) it is the compute that, played with the program, ends when the measured compute
    does; elsewhere the measured compute itself."""
    from psarch.theory import program_on_links, config_for, pure_compute
    from psarch.theory.simulate import play

    cfg = config_for(kind, 4, **options)   # 1 Gbit/s links: 4 MB in 3 passes, about 0.07 s of a 0.5 s compute
    assert registry.spec_of(cfg).compute_holds_waits(cfg) is holds
    phi, measured = 1e6, 0.5
    c = pure_compute(cfg, phi, measured, 1e-4)
    ops, _, end = play(*program_on_links(cfg, phi, c, None, 1e-4))
    last = max(end[k] for k, op in ops.items() if getattr(op, "seconds", 0) > 0)
    assert last == pytest.approx(measured, rel=1e-3)
    assert (c < measured - 0.01) is holds


def test_a_trainer_that_times_no_wait_gets_no_prediction_from_its_measured_step():
    """torch_fsdp times no wait apart (comm_s 0) on contended cores: its measured compute is the whole step, and a
    compute taken from it would predict the measured step by construction; cluster_step says nan instead. With its
    waits timed apart it is predicted."""
    from psarch.theory import cluster_step, config_for

    cfg = config_for("torch_fsdp", 4)
    whole = {"params": 1e6, "step_time_s": 0.5, "comm_s": 0.0, "cluster": {"alpha_s": 1e-4}}
    assert math.isnan(cluster_step(cfg, whole)["predicted_s"])
    apart = dict(whole, comm_s=0.05)
    assert cluster_step(cfg, apart)["predicted_s"] > 0.45


@pytest.mark.parametrize("kind, embeddings", [("ddp", "rows"), ("ddp", "sharded"), ("torch_ddp", "rows")])
def test_an_embedding_rows_program_moves_theorys_bytes(kind, embeddings):
    """With compute 0 and no latency a step with embedding rows is its bytes at the link's rate: the dense layers'
    all-reduce and the rows' all-gathers (rows) or all-to-alls (sharded), at theory's expected rows per rank."""
    from psarch.theory import predict

    cfg = from_dict({"workload": {"model": "dlrm", "data": "clicks", "dlrm": {"rows": 10**5}},
                     "train": {"optimizer": "adagrad"},
                     "backend": {"kind": kind, "world_size": 4, "embeddings": embeddings, "bucket_cap_mb": 0.01}})
    phi = 4 * 10**5 * 16 + 20_000
    sent = predict(cfg, phi).link.sent
    for reduced in (False, True):
        p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), reduced)
        assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(sent / RATE, rel=1e-6)


def test_geo_exchanges_once_in_k_steps_and_async_waits_for_no_round():
    """From a config with compute 0 and no latency: GEO's step is sync's exchange shared by its k steps; async
    answers each worker's pull once that worker's own push is in, never after a round, so no step of it is longer
    than sync's (with every worker alike, as long: the servers' links bind both)."""
    from psarch.theory import config_for

    phi, n = 25e6, 4

    def step(**backend) -> float:
        cfg = config_for("ps", n, "fp32", "sgd", servers=2, partition_mb=0.0, **backend)
        p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), True)
        return simulate(p, Cluster.of(p, RATE)).step_s

    assert step(mode="geo", k_steps=4) == pytest.approx(step(mode="sync") / 4)
    assert step(mode="async") <= step(mode="sync") * (1 + 1e-9)
    from psarch.theory.program import Transfer

    for mode in ("sync", "async"):
        cfg = config_for("ps", n, "fp32", "sgd", servers=2, server_placement="colocated", mode=mode)
        for reduced in (False, True):
            pulls = [op for op in registry.spec_of(cfg).program(cfg, phi, DataStep.of(0.1), reduced).ops
                     if isinstance(op, Transfer) and op.name.startswith("pull")]
            waits = {a.split(".")[0] for op in pulls for a in op.after}
            # async: the worker's own push (or, beside its own server, its own backward), never a round
            assert pulls and (waits == {"round"} if mode == "sync" else "round" not in waits and "push" in waits)


@pytest.mark.parametrize("options", [{"servers": 1}, {"servers": 2, "mode": "geo", "k_steps": 2},
                                     {"servers": 4, "server_placement": "colocated", "mode": "async"}])
def test_a_ps_rows_program_moves_theorys_bytes_and_reduces(options):
    """The PS with embedding rows, from a config: with compute 0 and no latency through one dedicated server its
    step is the worker's row pull, then every worker's pushes and pulls through that server's link (theory's
    bytes); and its full and reduced programs agree within 1% with compute and latency in play."""
    from psarch.theory import predict

    n = 4
    cfg = from_dict({"workload": {"model": "dlrm", "data": "clicks", "dlrm": {"rows": 10**5}},
                     "train": {"optimizer": "adagrad", "global_batch": 64},
                     "backend": {"kind": "ps", "world_size": n, "embeddings": "rows", "partition_mb": 0.0, **options}})
    phi = 4 * 10**5 * 16 + 20_000
    spec = registry.spec_of(cfg)
    if options["servers"] == 1:
        link = predict(cfg, phi).link
        p = spec.program(cfg, phi, DataStep(0.0, 0.0), False)
        assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(n * (link.sent + link.received) / RATE,
                                                                       rel=0.02)
    full, reduced = (spec.program(cfg, phi, STEP, r) for r in (False, True))
    a = simulate(full, Cluster.of(full, RATE, ALPHA)).step_s
    assert simulate(reduced, Cluster.of(reduced, RATE, ALPHA)).step_s == pytest.approx(a, rel=0.01)


@pytest.mark.parametrize("backend", [{"kind": "ddp"}, {"kind": "ddp", "server_placement": "colocated"},
                                     {"kind": "zero", "stage": 1}, {"kind": "zero", "stage": 3}])
def test_a_hybrid_program_moves_the_rows_beside_the_dense_layers(backend):
    """ddp and ZeRO with the tables on PS servers, from a config: with compute 0 and no latency the step takes
    at least the dense layers' collectives and each rank's rows through its link, at most the two one after the
    other; its reduced program (a node per kind of alike ranks, the ring step by step) times it as the full one
    does, within 1% with compute and latency in play."""
    from psarch.theory import predict

    n = 4
    cfg = from_dict({"workload": {"model": "dlrm", "data": "clicks", "dlrm": {"rows": 10**5}},
                     "train": {"optimizer": "adagrad", "global_batch": 256},
                     "backend": {"world_size": n, "embeddings": "ps", "servers": 2, **backend}})
    phi = 4 * 10**5 * 16 + 20_000
    spec, link = registry.spec_of(cfg), predict(cfg, phi).link
    for reduced in (False, True):
        p = spec.program(cfg, phi, DataStep(0.0, 0.0), reduced)
        got = simulate(p, Cluster.of(p, RATE)).step_s
        assert max(link.sent, link.received) / RATE * (1 - 1e-6) <= got <= (link.sent + link.received) / RATE * 1.01
    full, reduced_ = (spec.program(cfg, phi, STEP, r) for r in (False, True))
    assert len(reduced_.nodes) < len(full.nodes)
    a = simulate(full, Cluster.of(full, RATE, ALPHA)).step_s
    assert simulate(reduced_, Cluster.of(reduced_, RATE, ALPHA)).step_s == pytest.approx(a, rel=0.01)


def test_ddps_program_takes_the_trainers_own_buckets():
    """ddp's trainer closes a bucket at a parameter's edge (collective/bucket.py's assign_buckets): its program
    all-reduces those buckets, not Φ cut at the cap, where the config's model holds Φ; a Φ asked about alone (the
    estimator's) is cut at the cap."""
    from collective.theory import ddp_bucket_shapes
    from psarch.theory.program import Transfer
    from psarch.workload import build_workload

    cfg = from_dict({"train": {"steps": 4}, "backend": {"kind": "ddp", "world_size": 4, "bucket_cap_mb": 0.05}})
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters())
    want = [4.0 * sum(math.prod(s) for s in bucket) for bucket in ddp_bucket_shapes(cfg)]

    def moved(p: float) -> list[float]:
        program = registry.spec_of(cfg).program(cfg, p, DataStep.of(0.1), True)
        return [op.bytes * 2 / 3 for op in program.ops if isinstance(op, Transfer)]   # 2(N-1)/N of each bucket

    assert moved(phi) == pytest.approx(want)
    assert moved(phi) != pytest.approx(chunks(4.0 * phi, 0.05 * 2**20))
    assert moved(phi + 1) == pytest.approx(chunks(4.0 * (phi + 1), 0.05 * 2**20))


def test_ddps_buckets_follow_the_lora_targets():
    """Adapters on blocks.0.mlp.0 or on blocks.0.mlp.2 train the same Φ in different shapes: each config gets its
    own trainer's buckets (ddp_bucket_shapes), not the other's from the cache."""
    from collective.theory import ddp_bucket_shapes, trainer_buckets
    from psarch.workload import build_workload

    def cfg_of(target: str):
        return from_dict({"train": {"steps": 4, "lora_rank": 2, "lora_targets": [target]},
                          "backend": {"kind": "ddp", "world_size": 4, "bucket_cap_mb": 1e-6}})

    cfgs = [cfg_of("blocks.0.mlp.0"), cfg_of("blocks.0.mlp.2")]
    phis = {sum(p.numel() for p in build_workload(c, device="meta").model.parameters() if p.requires_grad)
            for c in cfgs}
    assert len(phis) == 1
    phi = phis.pop()
    want = [[4.0 * sum(math.prod(s) for s in bucket) for bucket in ddp_bucket_shapes(c)] for c in cfgs]
    assert want[0] != want[1]
    assert [trainer_buckets(c, phi) for c in cfgs] == want


@pytest.mark.parametrize("kind", ["tensor", "torch_tensor"])
@pytest.mark.parametrize("train", [{"lora_rank": 4}, {"lora_rank": 2, "lora_alpha": 4.0},
                                   {"trainable": ["head.weight", "blocks.*.mlp.*"]}, {}])
def test_a_tensor_program_moves_theorys_bytes_with_lora_and_frozen_parameters(kind, train):
    """With compute 0 and no latency a tensor-parallel step is its bytes at the link's rate, predict()'s: the f's
    that nothing upstream needs are skipped and each adapter's rank-r all-reduce is in (tp_linears, one source)."""
    from psarch.theory import predict
    from psarch.workload import build_workload

    cfg = from_dict({"train": {"steps": 2, **train}, "backend": {"kind": kind, "world_size": 2}})
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters() if p.requires_grad)
    sent = predict(cfg, phi).per_rank[0].link.sent
    for reduced in (False, True):
        p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), reduced)
        assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(sent / RATE, rel=1e-9)


@pytest.mark.parametrize("train", [{"lora_rank": 2}, {"trainable": ["head.weight", "blocks.1.*"]}, {},
                                   {"trainable": ["head.weight", "blocks.0.*"]},
                                   {"lora_rank": 2, "lora_targets": ["blocks.1.*"]}])
@pytest.mark.parametrize("backend", [{"kind": "zero", "stage": 3}, {"kind": "torch_fsdp"}], ids=["zero3", "fsdp2"])
def test_a_zero3_program_gathers_the_frozen_weights_as_predict_counts(train, backend):
    """With compute 0 and no latency a ZeRO-3 step is its bytes at the link's rate, predict()'s: each unit's
    trainable parameters gathered twice and reduce-scattered, its frozen ones (padded to N as they are sharded)
    gathered twice and never reduced, once where backward never reaches the unit (block 0 where only block 1 and the
    head train, or LoRA adapts block 1 alone: nothing trains in it or before it); a block of frozen weights only
    reduces nothing. FSDP2's (torch_fsdp) gathers its root once, kept from forward through backward, and the frozen
    weights of a block backward does not reach where the block after it prefetches them."""
    from psarch.theory import predict
    from psarch.workload import build_workload

    cfg = from_dict({"train": {"steps": 2, "global_batch": 12, **train}, "workload": {"gpt": {"n_layer": 2}},
                     "backend": {**backend, "world_size": 3}})
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters() if p.requires_grad)
    sent = predict(cfg, phi).link.sent
    for reduced in (False, True):
        p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), reduced)
        assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(sent / RATE, rel=1e-3)


@pytest.mark.parametrize("colocated", [False, True])
def test_a_ps_workers_rows_ride_the_connections_of_its_pushes_and_pulls(colocated):
    """Row keys and row pushes ride ("push", worker, server index) as the partitions' pushes do, rows and pulls
    ("pull", server index, worker): with dedicated servers (server j on node n + j) one connection per pair."""
    from psarch.theory.program import Transfer

    n, k = 4, 2
    p = ps_program(n, [SLOTS] * k, colocated, STEP, rows=RowBytes(8e3, 1e5, 1e5))
    where = list(range(k)) if colocated else [n + j for j in range(k)]
    transfers = [op for op in p.ops if isinstance(op, Transfer)]
    assert any(op.name.startswith("rowkeys") for op in transfers)
    for op in transfers:
        way, a, b = op.conn
        assert (op.src, op.dst) == ((a, where[b]) if way == "push" else (where[a], b)), op.name


def test_the_hybrids_zero3_units_leave_the_tables_to_the_servers():
    """ZeRO-3 with the tables on PS servers gathers the dense units alone, as its trainer holds them (the tables
    frozen placeholders): the DLRM's root, its tables, is empty, its MLP blocks share Φ by their sizes; without
    the servers the tables are the root's."""
    from psarch.workload import build_workload
    from zero.theory import unit_shares

    base = {"workload": {"model": "dlrm", "data": "clicks", "dlrm": {"rows": 10**5}},
            "train": {"optimizer": "adagrad", "global_batch": 64}}
    cfg = from_dict({**base, "backend": {"kind": "zero", "stage": 3, "world_size": 4, "embeddings": "ps",
                                         "servers": 2}})
    blocks = [sum(p.numel() for p in b.parameters()) for b in build_workload(cfg, device="meta").model.blocks]
    assert unit_shares(cfg) == pytest.approx([0.0] + [b / sum(blocks) for b in blocks])
    dense = from_dict({**base, "backend": {"kind": "zero", "stage": 3, "world_size": 4}})
    assert unit_shares(dense)[0] > 0.99
