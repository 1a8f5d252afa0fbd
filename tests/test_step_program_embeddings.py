"""Programs with embedding rows from a config: ddp's rows all-gathered or all-to-all, the PS's rows pulled and
pushed on its workers' connections, and the hybrids (ddp or ZeRO over the dense layers, the tables on PS servers):
their bytes are theory's and their reduced programs time them as the full ones do."""
from __future__ import annotations

import pytest

from psarch import registry
from psarch.config import from_dict
from psarch.ps.program import RowBytes, ps_program
from psarch.theory.program import Cluster, DataStep
from psarch.theory.simulate import simulate
from test_step_programs import ALPHA, RATE, SLOTS, STEP


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
