"""Parameter server: parity with `single` and DDP, the modes' guarantees, traffic, the update rules.

Parity (fp32, rtol 1e-4 / atol 1e-5 after 6 steps, AdamW eps 1e-6, as in test_ddp.py): `sync` with 1 and
2 servers and 2 and 3 workers ends with the model of `single` and of psarch DDP; `geo` with the barrier,
k=1 and plain SGD ends with the model of `sync`; `async` with one worker ends with `single`'s. Each world
size runs every variant inside one spawned group, against servers running as threads of the test
process (the server code is the same; the server *processes* are exercised in test_ps_faults.py).
A missing or wrong synchronisation moves parameters by about one learning rate, 1000x the tolerance.

Header overhead bound: each step a worker sends one `pushpull` request to each server and gets one
`params` reply; every header frame is at most HEADER_BOUND = 128 bytes (measured: pushpull 79-105,
params 78-94 bytes, before each named its request's id: 13 bytes more), so per step a worker sends at most S + servers·128 bytes and receives at most as
much (S: the gradients / parameters in the wire dtype).
"""
from __future__ import annotations


import pytest
import torch

from dist_utils import run_ranks
from parity import ATOL, assert_same_model, model, train
from psarch.config import from_dict
from psarch.ps.services import start_services
from psarch.workload import build_workload
from ps_setup import OPTIMIZERS, TINY_GPT, config, ps
from timing import scaled

HEADER_BOUND = 128
PARTS = 0.001   # MiB: partitions of 256 elements, several per server of the tiny GPT


def plan(n: int) -> dict[str, dict]:
    """Every configuration one world size runs, by name."""
    runs = {}
    for opt in ("sgd", "adamw"):
        runs[f"ddp-{opt}-{n}"] = config(f"ddp-{opt}-{n}", train=OPTIMIZERS[opt],
                                        backend={"kind": "ddp", "comm": "native", "world_size": n})
        for s in (1, 2):
            runs[f"sync-s{s}-{opt}-{n}"] = config(f"sync-s{s}-{opt}-{n}", train=OPTIMIZERS[opt],
                                                  backend=ps(n, servers=s))
        # the same in partitions (pushed from backward's hooks, as above), and whole ranges pushed after backward
        for name, extra in ((f"sync-s2-{opt}-{n}-parts", {"partition_mb": PARTS, "partition_assignment": "ranges"}),
                            (f"sync-s2-{opt}-{n}-prio", {"partition_mb": PARTS, "priority_credit_mb": PARTS}),
                            (f"sync-s2-{opt}-{n}-rr", {"partition_mb": PARTS, "partition_assignment": "round_robin"}),
                            (f"sync-s2-{opt}-{n}-plain", {"overlap_comm": False})):
            runs[name] = config(name, train=OPTIMIZERS[opt], backend=ps(n, servers=2, **extra))
    if n == 2:
        runs["sync-plain_sgd-2"] = config("sync-plain_sgd-2", train=OPTIMIZERS["plain_sgd"], backend=ps(2))
        runs["geo-plain_sgd-2"] = config("geo-plain_sgd-2", train=OPTIMIZERS["plain_sgd"],
                                         backend=ps(2, "geo", servers=2, k_steps=1, geo_barrier=True))
        runs["geo-plain_sgd-2-parts"] = config("geo-plain_sgd-2-parts", train=OPTIMIZERS["plain_sgd"],
                                               backend=ps(2, "geo", servers=2, k_steps=1, geo_barrier=True,
                                                          partition_mb=PARTS))
        runs["geo-async-2"] = config("geo-async-2", train=OPTIMIZERS["adamw"],
                                     backend=ps(2, "geo", servers=2, k_steps=2))
        for precision in ("bf16", "fp16"):
            runs[precision] = config(precision, workload={"model": "mlp"}, backend=ps(2, servers=2),
                                     train={"optimizer": "adamw", "lr": 1e-2, "steps": 40, "precision": precision})
    return runs


def all_variants(rank: int, n: int, out: str, runs: dict, infos: dict) -> dict:
    return {name: train(rank, n, data, infos.get(name, {}), out) for name, data in runs.items()}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps")
    results, server_stats = {}, {}
    for opt in ("sgd", "adamw"):
        train(0, 1, config(f"single-{opt}", train=OPTIMIZERS[opt]), {}, str(out))
    one = {f"async-1-{opt}": config(f"async-1-{opt}", train=OPTIMIZERS[opt], backend=ps(1, "async", 2))
           for opt in ("sgd", "adamw")}
    one["async-1-dc-adamw"] = config("async-1-dc-adamw", train=OPTIMIZERS["adamw"],
                                     backend=ps(1, "async", 1, staleness_compensation="dc"))
    one["async-1-parts-adamw"] = config("async-1-parts-adamw", train=OPTIMIZERS["adamw"],
                                        backend=ps(1, "async", 2, partition_mb=PARTS, partition_assignment="ranges"))
    one["async-1-prio-adamw"] = config("async-1-prio-adamw", train=OPTIMIZERS["adamw"],
                                       backend=ps(1, "async", 2, partition_mb=PARTS, priority_credit_mb=PARTS,
                                                  partition_assignment="ranges"))
    one["async-1-rr-prio-adamw"] = config("async-1-rr-prio-adamw", train=OPTIMIZERS["adamw"],
                                          backend=ps(1, "async", 2, partition_mb=PARTS, priority_credit_mb=PARTS,
                                                     partition_assignment="round_robin"))
    for n, runs in [(1, one), (2, plan(2)), (3, plan(3))]:
        services = {name: start_services(from_dict(d), None, threads=True)
                    for name, d in runs.items() if d["backend"]["kind"] == "ps"}
        try:
            infos = {name: s.info for name, s in services.items()}
            if n == 1:
                res = [all_variants(0, 1, str(out), runs, infos)]
            else:
                res = run_ranks(all_variants, n, str(out), runs, infos, timeout=scaled(300))
            for name, s in services.items():
                server_stats[name] = s.finish()
        finally:
            for s in services.values():
                s.stop()
        for rank, r in enumerate(res):
            for name, v in r.items():
                results.setdefault(name, {})[rank] = v
    return out, results, server_stats


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [2, 3])
def test_sync_equals_single_and_ddp(parity, opt, n):
    out, _, stats = parity
    ref = model(out, f"single-{opt}")
    init = build_workload(from_dict(TINY_GPT)).model.state_dict()
    assert max((ref[k] - v).abs().max().item() for k, v in init.items()) > 100 * ATOL, "reference barely trained"
    ddp = model(out, f"ddp-{opt}-{n}")
    for s in (1, 2):
        mine = model(out, f"sync-s{s}-{opt}-{n}")
        assert_same_model(mine, ref, f"ps sync S={s} N={n} vs single")
        assert_same_model(mine, ddp, f"ps sync S={s} N={n} vs DDP")
        assert [x["version"] for x in stats[f"sync-s{s}-{opt}-{n}"]["servers_detail"]] == [6] * s


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [2, 3])
def test_sync_in_partitions_and_from_backward_hooks_is_bit_identical(parity, opt, n):
    """Pushed from backward's hooks (overlap_comm) with whole ranges, or in partitions of 256 elements (each
    server's range, or dealt round robin): the model is bit for bit that of whole ranges pushed after backward."""
    out, results, stats = parity
    plain = model(out, f"sync-s2-{opt}-{n}-plain")
    for name in (f"sync-s2-{opt}-{n}", f"sync-s2-{opt}-{n}-parts", f"sync-s2-{opt}-{n}-prio",
                 f"sync-s2-{opt}-{n}-rr"):
        mine = model(out, name)
        assert plain.keys() == mine.keys() and all(torch.equal(plain[k], mine[k]) for k in plain), name
    dealt = [x["range"] for x in stats[f"sync-s2-{opt}-{n}-rr"]["servers_detail"]]
    assert dealt[0][1] > dealt[1][0], f"round robin: server 0's partitions do not interleave with server 1's {dealt}"
    parts = [x["partitions"] for x in stats[f"sync-s2-{opt}-{n}-parts"]["servers_detail"]]
    assert min(parts) >= 4 and [x["partitions"] for x in stats[f"sync-s2-{opt}-{n}"]["servers_detail"]] == [1, 1]
    for r in results[f"sync-s2-{opt}-{n}-parts"].values():   # a request and a reply per partition each step
        payload = r["params"] * 4
        assert all(payload < row[k] <= payload + sum(parts) * HEADER_BOUND for row in r["rows"]
                   for k in ("sent", "received"))


def test_geo_with_barrier_k1_plain_sgd_equals_sync(parity):
    out, _, _ = parity
    assert_same_model(model(out, "geo-plain_sgd-2"), model(out, "sync-plain_sgd-2"), "geo k=1 barrier vs sync")
    assert_same_model(model(out, "geo-plain_sgd-2-parts"), model(out, "sync-plain_sgd-2"),
                      "geo k=1 barrier in partitions vs sync")


@pytest.mark.parametrize("name", ["async-1-sgd", "async-1-adamw", "async-1-dc-adamw", "async-1-parts-adamw",
                                  "async-1-prio-adamw", "async-1-rr-prio-adamw"])
def test_async_with_one_worker_equals_single(parity, name):
    out, _, stats = parity
    assert_same_model(model(out, name), model(out, f"single-{name.rsplit('-', 1)[1]}"), f"{name} vs single")
    parts = sum(x["partitions"] for x in stats[name]["servers_detail"])   # a push of each partition, each step
    assert stats[name]["staleness"]["histogram"] == {"0": 6 * parts}


@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("n", [2, 3])
def test_sync_traffic_is_gradients_pushed_plus_parameters_pulled(parity, n, servers):
    _, results, stats = parity
    name = f"sync-s{servers}-adamw-{n}"
    sent = received = 0
    for rank, r in results[name].items():
        payload = r["params"] * 4
        for row in r["rows"]:
            for got in (row["sent"], row["received"]):
                assert payload < got <= payload + servers * HEADER_BOUND, (rank, row)
        sent += r["traffic"]["sent"]
        received += r["traffic"]["received"]
        assert r["memory"]["params"] == r["memory"]["grads"] == payload and r["memory"]["optimizer"] == 0
    srv = stats[name]["traffic"]["servers"]
    assert sum(s["received"] for s in srv) == sent and sum(s["sent"] for s in srv) == received
    for m in stats[name]["memory"]["servers"]:
        assert m["params"] == 4 * m["held"] and m["optimizer"] >= 8 * m["held"]   # AdamW moments live here


def test_geo_without_barrier_pushes_deltas_every_k_steps(parity):
    """GEO (k = 2, no barrier): workers run AdamW locally (optimizer state on the worker), push a delta
    and pull every 2nd step only (each server adds every delta at once: 2 workers x 3 rounds)."""
    _, results, stats = parity
    s = stats["geo-async-2"]
    assert [d["version"] for d in s["servers_detail"]] == [6, 6]
    assert sum(s["staleness"]["histogram"].values()) == 2 * 6
    for r in results["geo-async-2"].values():
        phi = r["params"]
        assert r["memory"]["optimizer"] >= 8 * phi                     # local AdamW moments
        assert [x["sent"] > 0 for x in r["rows"]] == [False, True] * 3  # traffic on round steps only
        assert all(4 * phi < x["sent"] <= 4 * phi + 2 * HEADER_BOUND for x in r["rows"][1::2])
    assert all(m["optimizer"] == 0 for m in s["memory"]["servers"])   # GEO servers only add deltas


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_workers_push_compute_dtype_and_converge(parity, precision):
    """Workers hold 16-bit parameters and gradients and no optimizer; the wire carries 16-bit tensors
    both ways (S = 2Φ); the servers keep fp32 parameters and AdamW state (fp16: their loss scale)."""
    _, results, stats = parity
    for rank, r in results[precision].items():
        losses = [x["loss"] for x in r["rows"]]
        assert losses[0] - losses[-1] > 1.0, f"{precision} PS did not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"
        phi = r["params"]
        assert r["memory"]["params"] == r["memory"]["grads"] == 2 * phi and r["memory"]["optimizer"] == 0
        assert all(2 * phi < x["sent"] <= 2 * phi + 2 * HEADER_BOUND for x in r["rows"])
    for m in stats[precision]["memory"]["servers"]:
        assert m["params"] == 4 * m["held"] and m["optimizer"] >= 8 * m["held"]


@pytest.mark.parametrize("compensation", ["none", "lr", "dc"])
def test_staleness_compensation_rules(compensation):
    """One stale gradient (τ = 3) on a server range, plain SGD: none = w - lr·g; lr = w - lr/τ·g;
    dc = w - lr·(g + λ·g⊙g⊙(w_now - w_bak)) with w_bak the parameters last sent to that worker."""
    from psarch.ps.server.updates import RangeState

    cfg = from_dict(config("comp", train={"optimizer": "sgd", "lr": 0.1},
                           backend=ps(2, "async", staleness_compensation=compensation, dc_lambda=0.5)))
    w = torch.randn(50)
    st = RangeState(w, cfg, workers=2)
    st.remember_sent(1)                           # worker 1 pulled w
    with torch.no_grad():
        st.params.add_(0.25)                      # three other updates moved the parameters since
    st.version = 3
    g = torch.randn(50)
    st.apply_gradient(g.clone(), staleness=3, worker=1, push_scale=1.0, found_inf=False)
    now = w + 0.25
    expected = {"none": now - 0.1 * g, "lr": now - 0.1 / 3 * g,
                "dc": now - 0.1 * (g + 0.5 * g * g * (now - w))}[compensation]
    torch.testing.assert_close(st.params.data, expected)
    assert st.staleness == {3: 1} and st.version == 4
