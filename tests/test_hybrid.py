"""The hybrid (backend.embeddings = "ps" on ddp and zero, collective/ps_tables.py): the tables on 2 PS servers, the
dense layers ring all-reduced (ddp) or sharded (ZeRO stages 1-3), on dlrm/clicks at N = 2. Sync: ends with the
model of `single` (SGD within 1e-5 absolute, Adagrad within tests/parity.py's tolerances) and of ddp with
embeddings = "rows"; each step's bytes are the dense collective's plus the rows pulled and pushed (the PS's
rows_traffic at the measured distinct ids, and the requests' headers); theory's prediction is that formula at
E[u]; the combinations it does not run are refused in one line (compressed: tests/test_compression_embeddings.py)."""
from __future__ import annotations

import pytest
import torch

from collective.comm import ring_bytes
from collective.spec import DDP
from dist_utils import run_ranks
from parity import ATOL, SGD_ATOL, assert_same_model, config, model, train, train_plan
from psarch import theory
from psarch.config import ConfigError, from_dict
from psarch.ps import theory as ps_theory
from psarch.ps.messages import RID_BYTES
from psarch.ps.services import LocalServers
from psarch.embeddings import embedding_tables
from psarch.workload import build_workload
from test_ps_rows import OPTIMIZERS, ROWS_DLRM as DLRM   # the same workload as the PS rows tests
from timing import scaled

N, SERVERS = 2, 2
HYBRID = {"kind": "ddp", "embeddings": "ps", "servers": SERVERS, "bucket_cap_mb": 0}   # a bucket per dense parameter
RUNS = {**{f"hybrid-{comm}-{opt}": (dict(HYBRID, comm=comm), opt) for comm in ("ring", "native") for opt in OPTIMIZERS},
        **{f"hybrid-zero{stage}-sgd": ({"kind": "zero", "stage": stage, "embeddings": "ps", "servers": SERVERS}, "sgd")
           for stage in (1, 2, 3)},
        "hybrid-zero2-adagrad": ({"kind": "zero", "stage": 2, "embeddings": "ps", "servers": SERVERS}, "adagrad"),
        **{f"ddp-rows-{opt}": ({"kind": "ddp", "embeddings": "rows"}, opt) for opt in OPTIMIZERS}}
# header bytes per server per step: rowpull + rowpush sent (their headers), rows + ack received (measured: 67 + 72
# and 49 + 17, a few bytes more or less with the integers' msgpack sizes, before every header named a request's id:
# 13 bytes more each, psarch/ps/messages.py's RID)
SENT_HEADERS, RECEIVED_HEADERS = (125 + 2 * RID_BYTES, 155 + 2 * RID_BYTES), (60 + 2 * RID_BYTES, 90 + 2 * RID_BYTES)


def _data(name: str, opt: str, backend: dict | None = None, n: int = N) -> dict:
    b = dict(backend, world_size=n) if backend else {"kind": "single"}
    return config(name, base=DLRM, train=OPTIMIZERS[opt], backend=b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("hybrid")
    for opt in OPTIMIZERS:
        train(0, 1, _data(f"single-{opt}", opt), {}, str(out))
    plan = {name: _data(name, opt, backend) for name, (backend, opt) in RUNS.items()}
    services = {name: LocalServers(from_dict(d), None, threads=True) for name, d in plan.items() if "hybrid" in name}
    try:
        infos = {name: services[name].info.to_dict() if name in services else {} for name in plan}
        res = run_ranks(train_plan, N, str(out), plan, infos, timeout=scaled(300))
        servers = {name: s.finish() for name, s in services.items()}
    finally:
        for s in services.values():
            s.stop()
    return out, {name: [r[name] for r in res] for name in plan}, servers


HYBRIDS = [name for name in RUNS if name.startswith("hybrid")]


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_equals_single_and_ddp_rows(runs, name):
    out, _, _ = runs
    opt = RUNS[name][1]
    ref = model(out, f"single-{opt}")
    init = build_workload(from_dict(DLRM)).model.state_dict()
    assert max((ref[k] - v).abs().max().item() for k, v in init.items()) > 100 * ATOL, "reference barely trained"
    got = model(out, name)
    if opt == "sgd":   # every parameter within 1e-5 absolute of single's
        assert_same_model(got, ref, f"{name} vs single", rtol=0, atol=SGD_ATOL)
    else:
        assert_same_model(got, ref, f"{name} vs single")
    assert_same_model(got, model(out, f"ddp-rows-{opt}"), f"{name} vs ddp rows")


@pytest.mark.parametrize("name", [n for n in HYBRIDS if "zero" not in n])
def test_bytes_per_step_are_the_dense_all_reduce_plus_the_rows(runs, name):
    """All-reduce: exactly the ring's volume over the dense parameters (a bucket each); rows: 8 B per key out with
    the pull and again with the push, u·dim fp32 of gradients out and of rows in (u: this rank's distinct ids,
    measured), plus each server's request and reply headers."""
    _, results, _ = runs
    cfg = from_dict(_data(name, "sgd", RUNS[name][0]))
    m = build_workload(from_dict(_data("dense", "sgd"))).model
    tables = {id(t.weight) for _, t in embedding_tables(m)}
    dense = [p.numel() for p in m.parameters() if id(p) not in tables]
    ring = sum(ring_bytes("all_reduce", k, 4, N)[0] for k in dense)
    for rank, r in enumerate(results[name]):
        steps = cfg.train.steps
        assert r["traffic"]["ops"]["all_reduce"]["sent"] == r["traffic"]["ops"]["all_reduce"]["received"] == steps * ring
        for step, row in enumerate(r["rows"]):
            u = row["extra"]["unique_ids"]
            assert u >= cfg.workload.dlrm.num_tables, (rank, step, u)
            rows = ps_theory.rows_traffic(u, cfg.workload.dlrm.dim, 0, 4)
            lo, hi = SENT_HEADERS
            assert SERVERS * lo <= row["sent"] - ring - rows.sent <= SERVERS * hi, (name, rank, step, row)
            lo, hi = RECEIVED_HEADERS
            assert SERVERS * lo <= row["received"] - ring - rows.received <= SERVERS * hi, (name, rank, step, row)


@pytest.mark.parametrize("name", [n for n in HYBRIDS if "zero" in n])
def test_zero_bytes_per_step_are_its_collectives_plus_the_rows(runs, name):
    """ZeRO's steps: what its reduce-scatters and all-gathers moved (a step's share of the run's), plus the rows
    as above."""
    _, results, _ = runs
    d = DLRM["workload"]["dlrm"]
    steps = DLRM["train"]["steps"]
    for rank, r in enumerate(results[name]):
        ops = r["traffic"]["ops"]
        dense = (ops["reduce_scatter"]["sent"] + ops["all_gather"]["sent"]) / steps   # sent = received
        assert ops["reduce_scatter"]["received"] + ops["all_gather"]["received"] == steps * dense
        for step, row in enumerate(r["rows"]):
            rows = ps_theory.rows_traffic(row["extra"]["unique_ids"], d["dim"], 0, 4)
            for got, want, (lo, hi) in ((row["sent"], rows.sent, SENT_HEADERS),
                                        (row["received"], rows.received, RECEIVED_HEADERS)):
                assert SERVERS * lo <= got - want - dense <= SERVERS * hi, (name, rank, step, row, dense)


def test_prediction_is_the_formula_at_the_expected_unique_ids(runs):
    """predict: the dense ring all-reduce plus rows_traffic at E[u] (headers not counted), near the measured."""
    _, results, _ = runs
    name = "hybrid-ring-sgd"
    cfg = from_dict(_data(name, "sgd", RUNS[name][0]))
    phi = results[name][0]["params"]
    d = cfg.workload.dlrm
    dense = phi - d.num_tables * d.rows * d.dim
    u = theory.expected_unique_ids(cfg)
    ring = 2 * (N - 1) / N * 4 * dense
    p = DDP.predict(cfg, phi)
    assert p.link.sent == pytest.approx(ring + 16 * u + 4 * u * d.dim)
    assert p.link.received == pytest.approx(ring + 4 * u * d.dim)
    assert p.nodes["server"].link.received == pytest.approx(N * (16 * u + 4 * u * d.dim) / SERVERS)
    measured = [row["extra"]["unique_ids"] for r in results[name] for row in r["rows"]]
    assert sum(measured) / len(measured) == pytest.approx(u, rel=0.15)


def test_the_servers_hold_the_tables_and_no_dense_range(runs):
    _, results, servers = runs
    d = DLRM["workload"]["dlrm"]
    for name in HYBRIDS:
        held = servers[name]["memory"]["servers"]
        assert [s["held"] for s in held] == [0] * SERVERS
        assert sum(s["embedding_bytes"] for s in held) == d["num_tables"] * d["rows"] * d["dim"] * 4
        for r in results[name]:   # a rank holds the last step's rows only, not the tables
            assert r["extra"]["embedding_bytes_held_peak"] < r["extra"]["embedding_table_bytes"] / 10


@pytest.mark.parametrize("backend, train_, words", [
    ({"kind": "torch_ddp", "embeddings": "ps"}, {}, 'backend.embeddings = "ps"'),
    ({"kind": "zero", "embeddings": "ps"}, {"precision": "bf16"}, "fp32 only"),
    ({"kind": "zero", "servers": 2}, {}, "backend.servers = 2"),
    ({"kind": "ps", "embeddings": "ps"}, {}, 'backend.embeddings = "ps"'),
    (HYBRID, {"precision": "bf16"}, "fp32 only"),
    (HYBRID, {"momentum": 0.9}, "momentum"),
    ({"kind": "zero", "stage": 2, "embeddings": "ps"}, {"compression": "topk"}, "ZeRO reduce-scatters gradients"),
    ({"kind": "ddp", "servers": 2}, {}, "backend.servers = 2"),
])
def test_combinations_it_does_not_run_are_refused_in_one_line(backend, train_, words):
    data = config("x", base=DLRM, train=dict(OPTIMIZERS["sgd"], **train_), backend=dict(backend, world_size=N))
    with pytest.raises(ConfigError) as e:
        from_dict(data)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_server_applies_a_round_once_every_rank_pushed_and_holds_the_next_pulls_until_then():
    """The servers' side (psarch/ps/server/rows.py, tables_only): worker 0's rowpull for step 1 waits for
    worker 1's rowpush of step 0; the round applies the mean gradient (SGD: row -= lr · Σ g / N), and a second
    push for a round or a pull past the next one is refused."""
    from psarch.ps.errors import PSError
    from psarch.ps.worker.client import PSClient, Request

    data = config("srv", base=DLRM, train=OPTIMIZERS["sgd"], backend=dict(HYBRID, servers=1, world_size=2))
    cfg = from_dict(data)
    dim, lr = cfg.workload.dlrm.dim, OPTIMIZERS["sgd"]["lr"]
    services = LocalServers(cfg, None, threads=True)
    info = services.info
    clients = [PSClient(info.addresses, w, 10.0, info.auth) for w in range(2)]
    keys = torch.tensor([3, 1007])   # row 3 of tables 0 and 1

    def pull(w: int, step: int, post_only: bool = False) -> Request:
        r = Request({"op": "rowpull", "step": step, "want": "float32"}, keys, into=torch.empty(2, dim))
        clients[w].post(0, r)
        if not post_only:
            clients[w].wait()
        return r

    def push(w: int, step: int, k: torch.Tensor, g: torch.Tensor) -> None:
        clients[w].exchange([[Request({"op": "rowpush", "step": step, "version": step}, g, keys=k)]])

    try:
        before = pull(0, 0).into.clone()
        g0, g1 = torch.randn(2, dim), torch.randn(1, dim)
        push(0, 0, keys, g0)
        with pytest.raises(PSError, match="has pushed its rows"):
            push(0, 0, keys, g0)
        with pytest.raises(PSError, match="applied 0 rounds"):
            pull(1, 1)
        waiting = pull(0, 1, post_only=True)
        with pytest.raises(PSError, match="no reply"):
            clients[0].wait(timeout_s=0.5)
        assert not waiting.answered
        push(1, 0, keys[:1], g1)
        clients[0].wait()
        assert waiting.answered
        want = before - lr * torch.stack([g0[0] + g1[0], g0[1]]) / 2
        torch.testing.assert_close(waiting.into, want, rtol=0, atol=1e-6)
    finally:
        for c in clients:
            c.close()
        services.stop()


@pytest.mark.parametrize("backend", [HYBRID, {"kind": "ps", "embeddings": "rows", "servers": SERVERS}])
def test_the_emulated_cluster_probes_a_worker_with_its_tables_held(backend):
    """An emulated run's device probe (psarch/cluster/core.py) runs forward and backward: where a worker's tables
    stay on the meta device (the hybrid, PS rows), it probes the same model with them held."""
    from psarch.cluster.core import probe_workload

    cfg = from_dict(config("probe", base=DLRM, train=OPTIMIZERS["sgd"], backend=dict(backend, world_size=N)))
    meta = build_workload(cfg).model
    assert any(p.is_meta for p in meta.parameters())
    w = probe_workload(cfg)
    assert not any(p.is_meta for p in w.model.parameters())
    assert sum(p.numel() for p in w.model.parameters()) == sum(p.numel() for p in meta.parameters())
    w.loss_fn(w.model, w.batch(0, 0, N)).backward()


def test_three_ranks_and_three_servers_equal_single(runs, tmp_path):
    """N = 3 over 3 servers (a round summed in worker order whatever order the pushes arrive in): single's model
    (the module's single-sgd), every parameter within 1e-5."""
    out, _, _ = runs
    torch.set_num_threads(1)
    data = _data("hybrid3", "sgd", dict(HYBRID, servers=3), n=3)
    services = LocalServers(from_dict(data), None, threads=True)
    try:
        run_ranks(train_plan, 3, str(tmp_path), {"hybrid3": data}, {"hybrid3": services.info.to_dict()},
                  timeout=scaled(300))
    finally:
        services.stop()
    assert_same_model(model(tmp_path, "hybrid3"), model(out, "single-sgd"), "hybrid N=3 vs single", rtol=0,
                      atol=SGD_ATOL)
