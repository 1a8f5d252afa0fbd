"""Compressed steps' programs from a config (ddp and torch_ddp with casts, top-k and PowerSGD; ZeRO with cast
gradients; the PS with top-k pushes; ddp's compressed buckets beside embedding rows, and the hybrids'), with compute 0
and no latency: their bytes at the link's rate are theory's, and PowerSGD pays α for each message it sends."""
from __future__ import annotations

import pytest

from psarch import registry
from psarch.config import from_dict
from psarch.theory.program import Cluster, DataStep
from psarch.theory.simulate import simulate
from test_step_programs import ALPHA, RATE, STEP

DLRM = {"workload": {"model": "dlrm", "data": "clicks", "dlrm": {"rows": 10**5}},
        "train": {"optimizer": "adagrad", "global_batch": 256, "steps": 10}}


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


def _dlrm(backend: dict, compression: str) -> tuple:
    """A dlrm config with `compression` (PowerSGD from the first step: every step's bytes are the compressed step's)
    and its trainable parameters."""
    from psarch.workload import theory_model

    warm = {"powersgd_warmup_steps": 0} if compression == "powersgd" else {}
    cfg = from_dict({**DLRM, "train": {**DLRM["train"], "compression": compression, **warm},
                     "backend": {"world_size": 4, **backend}})
    return cfg, sum(p.numel() for p in theory_model(cfg).parameters() if p.requires_grad)


@pytest.mark.parametrize("embeddings", ["rows", "sharded"])
@pytest.mark.parametrize("compression", ["fp16", "topk", "powersgd"])
def test_a_compressed_program_beside_embedding_rows_moves_theorys_bytes(embeddings, compression):
    """ddp's compressed buckets (the dense layers alone, several here) and, whole, the rows' all-gathers (rows) or
    all-to-alls (sharded): with compute 0 and no latency the step is theory's bytes at the link's rate, the
    compressed dense part plus what the rows move without compression."""
    from collective.theory import rows_link

    from psarch.theory import predict

    backend = {"kind": "ddp", "embeddings": embeddings, "bucket_cap_mb": 0.01}
    cfg, phi = _dlrm(backend, compression)
    sent = predict(cfg, phi).link.sent
    uncompressed, _ = _dlrm(backend, "none")
    assert rows_link(cfg)[0] == rows_link(uncompressed)[0]   # the rows move whole
    for reduced in (False, True):
        p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), reduced)
        assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(sent / RATE, rel=2e-3), reduced


@pytest.mark.parametrize("backend, compression", [({"kind": "ddp"}, "fp16"), ({"kind": "ddp"}, "topk"),
                                                  ({"kind": "ddp", "server_placement": "colocated"}, "powersgd"),
                                                  ({"kind": "zero", "stage": 2}, "bf16")])
def test_a_compressed_hybrid_program_moves_the_rows_beside_the_compressed_buckets(backend, compression):
    """ddp or ZeRO over the dense layers, compressed, the tables on 2 PS servers: in the full program the last rank
    sends theory's bytes (the compressed collectives and its rows: predict's, within the ring chunks' padding, which
    predict counts and the program does not); with compute 0 and no latency the step takes at least the busiest
    link's bytes (a rank's, or a server's: the rows of every rank), at most every link's one after the other; its
    reduced program times it as the full one does, within 1% with compute and latency in play."""
    from psarch.theory import predict
    from psarch.theory.program import Transfer

    backend = {**backend, "embeddings": "ps", "servers": 2}
    cfg, phi = _dlrm(backend, compression)
    p = predict(cfg, phi)
    rank, server = p.nodes["worker"].link, p.nodes["server"].link
    spec = registry.spec_of(cfg)
    full = spec.program(cfg, phi, DataStep(0.0, 0.0), False)
    last = cfg.backend.world_size - 1   # a rank with no server beside it (colocated: servers on ranks 0 and 1)
    sent = sum(op.bytes for op in full.ops if isinstance(op, Transfer) and op.src == last and op.dst != last)
    assert sent == pytest.approx(rank.sent, rel=2e-3)
    for reduced in (False, True):
        prog = spec.program(cfg, phi, DataStep(0.0, 0.0), reduced)
        got = simulate(prog, Cluster.of(prog, RATE)).step_s * RATE
        assert max(rank.sent, rank.received, server.sent, server.received) * (1 - 1e-3) <= got \
            <= (rank.sent + rank.received + server.sent + server.received) * 1.01, reduced
    full, reduced_ = (spec.program(cfg, phi, STEP, r) for r in (False, True))
    a = simulate(full, Cluster.of(full, RATE, ALPHA)).step_s
    assert simulate(reduced_, Cluster.of(reduced_, RATE, ALPHA)).step_s == pytest.approx(a, rel=0.01)


@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_a_compressed_ps_rows_program_moves_theorys_bytes(compression):
    """The PS with embedding rows (sync) and compressed dense pushes, through one dedicated server, with compute 0
    and no latency: every worker's row pull, rows, compressed push and whole pull through that server's link,
    theory's bytes (as test_step_program_embeddings.py's uncompressed rows, within 2%)."""
    from psarch.theory import predict

    cfg, phi = _dlrm({"kind": "ps", "embeddings": "rows", "servers": 1, "partition_mb": 0.0}, compression)
    link = predict(cfg, phi).link
    whole = predict(_dlrm({"kind": "ps", "embeddings": "rows", "servers": 1, "partition_mb": 0.0}, "none")[0], phi)
    assert link.sent < whole.link.sent and link.received == pytest.approx(whole.link.received)
    p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), False)
    assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(4 * (link.sent + link.received) / RATE, rel=0.02)
