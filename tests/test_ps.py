"""Parameter server: parity with `single` and DDP, the modes' guarantees, traffic, fuzzing, faults.

Parity (fp32, rtol 1e-4 / atol 1e-5 after 6 steps, AdamW eps 1e-6, as in test_ddp.py): `sync` with 1 and
2 servers and 2 and 3 workers ends with the model of `single` and of psarch DDP; `geo` with the barrier,
k=1 and plain SGD ends with the model of `sync`; `async` with one worker ends with `single`'s. Each world
size runs every variant inside one spawned group, against servers running as threads of the test
process (the server code is the same; the server *processes* are exercised by the launcher tests below).
A missing or wrong synchronisation moves parameters by about one learning rate, 1000x the tolerance.

Header overhead bound: each step a worker sends one `pushpull` request to each server and gets one
`params` reply; every header frame is at most HEADER_BOUND = 128 bytes (measured: pushpull 79-105,
params 78-94 bytes), so per step a worker sends at most S + servers·128 bytes and receives at most as
much (S: the gradients / parameters in the wire dtype).
"""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

import psarch
from dist_utils import run_ranks
from parity import ATOL, assert_same_model, model
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.launch import RunError
from psarch.ps import wire
from psarch.ps.client import PSClient, Request
from psarch.ps.layout import server_ranges
from psarch.ps.server import PSError
from psarch.ps.services import start_services
from psarch.runner import run_rank
from psarch.workload import build_workload

TINY_GPT = {
    "seed": 3,
    "workload": {"model": "gpt", "data": "markov", "seq_len": 8,
                 "gpt": {"n_layer": 1, "n_embd": 16, "n_head": 2}, "markov": {"vocab_size": 16, "branching": 3}},
    "train": {"steps": 6, "global_batch": 12, "log_every": 100},
}
OPTIMIZERS = {
    "sgd": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "adamw": {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6},
    "plain_sgd": {"optimizer": "sgd", "lr": 0.1},
}
HEADER_BOUND = 128


def config(name: str, **sections) -> dict:
    data = json.loads(json.dumps(TINY_GPT))
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    data["name"] = name
    return data


def ps(n: int, mode: str = "sync", servers: int = 1, **extra) -> dict:
    return dict({"kind": "ps", "world_size": n, "mode": mode, "servers": servers, "timeout_s": 60.0}, **extra)


def plan(n: int) -> dict[str, dict]:
    """Every configuration one world size runs, by name."""
    runs = {}
    for opt in ("sgd", "adamw"):
        runs[f"ddp-{opt}-{n}"] = config(f"ddp-{opt}-{n}", train=OPTIMIZERS[opt],
                                        backend={"kind": "ddp", "comm": "native", "world_size": n})
        for s in (1, 2):
            runs[f"sync-s{s}-{opt}-{n}"] = config(f"sync-s{s}-{opt}-{n}", train=OPTIMIZERS[opt],
                                                  backend=ps(n, servers=s))
    if n == 2:
        runs["sync-plain_sgd-2"] = config("sync-plain_sgd-2", train=OPTIMIZERS["plain_sgd"], backend=ps(2))
        runs["geo-plain_sgd-2"] = config("geo-plain_sgd-2", train=OPTIMIZERS["plain_sgd"],
                                         backend=ps(2, "geo", servers=2, k_steps=1, geo_barrier=True))
        runs["geo-async-2"] = config("geo-async-2", train=OPTIMIZERS["adamw"],
                                     backend=ps(2, "geo", servers=2, k_steps=2))
        for precision in ("bf16", "fp16"):
            runs[precision] = config(precision, workload={"model": "mlp"}, backend=ps(2, servers=2),
                                     train={"optimizer": "adamw", "lr": 1e-2, "steps": 40, "precision": precision})
    return runs


def train(rank: int, n: int, data: dict, info: dict, out: str) -> dict:
    """Run one config on this rank; rank 0 saves the model. Returns what the tests look at."""
    cfg = from_dict(data)
    ctx = DistContext(rank, n, rank, torch.device("cpu"), "gloo" if n > 1 else None)
    ctx.services = info
    record = run_rank(cfg, ctx, echo=False)
    if rank == 0:
        torch.save(record["model_state"], Path(out) / f"{cfg.name}.pt")
    return {"traffic": record["traffic"], "memory": record["memory"], "params": record["params"],
            "rows": [{k: r[k] for k in ("loss", "sent", "received")} for r in record["rows"]]}


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
    for n, runs in [(1, one), (2, plan(2)), (3, plan(3))]:
        services = {name: start_services(from_dict(d), None, threads=True)
                    for name, d in runs.items() if d["backend"]["kind"] == "ps"}
        try:
            infos = {name: s.info for name, s in services.items()}
            if n == 1:
                res = [all_variants(0, 1, str(out), runs, infos)]
            else:
                res = run_ranks(all_variants, n, str(out), runs, infos, timeout=300)
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


def test_geo_with_barrier_k1_plain_sgd_equals_sync(parity):
    out, _, _ = parity
    assert_same_model(model(out, "geo-plain_sgd-2"), model(out, "sync-plain_sgd-2"), "geo k=1 barrier vs sync")


@pytest.mark.parametrize("name", ["async-1-sgd", "async-1-adamw", "async-1-dc-adamw"])
def test_async_with_one_worker_equals_single(parity, name):
    out, _, stats = parity
    assert_same_model(model(out, name), model(out, f"single-{name.rsplit('-', 1)[1]}"), f"{name} vs single")
    assert stats[name]["staleness"]["histogram"] == {"0": 6 * len(stats[name]["servers_detail"])}


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
    for m, (lo, hi) in ((m, m["range"]) for m in stats[name]["memory"]["servers"]):
        assert m["params"] == 4 * (hi - lo) and m["optimizer"] >= 8 * (hi - lo)   # AdamW moments live here


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
        lo, hi = m["range"]
        assert m["params"] == 4 * (hi - lo) and m["optimizer"] >= 8 * (hi - lo)


@pytest.mark.parametrize("compensation", ["none", "lr", "dc"])
def test_staleness_compensation_rules(compensation):
    """One stale gradient (τ = 3) on a server range, plain SGD: none = w - lr·g; lr = w - lr/τ·g;
    dc = w - lr·(g + λ·g⊙g⊙(w_now - w_bak)) with w_bak the parameters last sent to that worker."""
    from psarch.ps.updates import RangeState

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


# ---------------------------------------------------------------- fuzz

def _malformed(rng: random.Random, count: int, n: int) -> list[list[bytes]]:
    """`count` messages a server owning `n` parameters must refuse, of many kinds; each push differs from
    a valid one (worker 0, step 0, version 0) in one respect. Worker 1 has pushed step 0 already, so
    its repeated or out-of-order pushes and pulls beyond either worker's next step are refused too."""
    good = {"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0, "dtype": "float32", "shape": [n],
            "frames": 1}
    payload = bytes(4 * n)

    def push(**over):
        h = dict(good)
        for k, v in over.items():
            if v is None:
                h.pop(k, None)
            else:
                h[k] = v
        return msgpack.packb(h)

    def pull(worker, step):
        return [msgpack.packb({"op": "pull", "worker": worker, "step": step, "want": "float32"})]

    kinds = [
        lambda: [rng.randbytes(rng.randint(1, 300))],
        lambda: [rng.randbytes(rng.randint(0, 50)) for _ in range(rng.randint(2, 6))],
        lambda: [msgpack.packb({"op": rng.choice(["", "PUSH", "shutdown", "stop", "stats", "ack", "params",
                                                  "error", "lost", rng.randbytes(4).hex()]), "worker": 0})],
        lambda: [push(dtype=rng.choice(["float16", "bfloat16", "int64", "float64", "bool"])), payload],
        lambda: [push(shape=[n + rng.choice([-1, 1, 7])]), payload],
        lambda: [push(shape=[n], offset=rng.randint(1, 10**6)), payload],
        lambda: [push(frames=rng.choice([0, 2, 5])), payload],
        lambda: [push()],
        lambda: [push(), payload, rng.randbytes(8)],
        lambda: [push(), payload[:rng.randint(0, len(payload) - 1)]],
        lambda: [push(**{rng.choice(["worker", "step", "version", "offset", "op"]): None}), payload],
        lambda: [push(**{rng.choice(["worker", "step", "version"]): rng.choice([-1, 1.5, "x", True, [1]])}), payload],
        lambda: [push(worker=rng.randint(2, 1000)), payload],
        lambda: [push(version=rng.randint(1, 100)), payload],
        lambda: [push(step=rng.randint(1, 100)), payload],
        lambda: [push(colour="blue"), payload],
        lambda: [push(op="pushpull", **{rng.choice(["dtype", "shape", "version"]): rng.choice(["int8", [3], 99])}),
                 payload],
        lambda: [push(op="pushpull", worker=rng.randint(2, 99)), payload],
        lambda: [msgpack.packb(rng.choice([[1, 2], 7, "push", None, b"\x00"]))],
        lambda: [msgpack.packb({"op": "init", "worker": 0, "numel": n, "offset": 0, "dtype": "float32",
                                "shape": [n], "frames": 1}), payload],
        lambda: [msgpack.packb({"op": "pull", "worker": 1, "step": 0, "want": rng.choice(["float16", "x", ""])})],
        lambda: [msgpack.packb({"op": "fetch", "worker": 9})],
        # semantic: well-formed, but not what this worker may send now
        lambda: [push(worker=1, op=rng.choice(["push", "pushpull"])), payload],          # repeated push
        lambda: [push(worker=1, step=rng.choice([2, 3, 99])), payload],                  # skips a step
        lambda: pull(0, rng.choice([1, 2, 10**6, 2**62])),                                # future pull
        lambda: pull(1, rng.choice([2, 3, 10**6])),
        lambda: [push(scale=rng.choice([0.0, -1.0, 1e-300, 3.0, 1.0, 65536.0, 0])), payload],  # fp32: no scale
        lambda: [push(found_inf=rng.choice([True, False])), payload],
    ]
    return [rng.choice(kinds)() for _ in range(count)]


FUZZ_MODES = {"sync": {}, "async": {}, "ssp": {"staleness_bound": 0}, "geo": {}, "geo-barrier": {"geo_barrier": True}}


@pytest.mark.parametrize("mode", list(FUZZ_MODES))
def test_fuzzed_messages_are_refused_and_change_nothing(mode):
    """Malformed, random and out-of-turn messages to a live server (worker 1 has pushed step 0): each
    gets an error reply, the parameters do not move, the server then serves a normal worker (and
    survives a frame over its size limit). Plain SGD, lr 0.5, so the final update is known."""
    extra, count = FUZZ_MODES[mode], 1200
    cfg = from_dict(config("fuzz", train={"optimizer": "sgd", "lr": 0.5},
                           backend=ps(2, mode.split("-")[0], timeout_s=60.0, **extra)))
    services = start_services(cfg, None, threads=True)
    addr = services.info["addresses"]
    zctx = zmq.Context()
    fuzzer, big = zctx.socket(zmq.DEALER), zctx.socket(zmq.DEALER)
    w0, w1 = PSClient(addr, 0, 10.0), PSClient(addr, 1, 10.0)
    try:
        for sock in (fuzzer, big):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr[0])
        numel = sum(p.numel() for p in build_workload(cfg).model.parameters())
        init, base = torch.empty(numel), torch.empty(numel)
        w0.exchange([[Request({"op": "fetch"}, into=init)]])   # the server built the model itself
        g1 = torch.randn(numel)
        w1.exchange([[Request({"op": "push", "step": 0, "version": 0, "offset": 0}, g1)]])
        w0.exchange([[Request({"op": "fetch"}, into=base)]])
        messages = _malformed(random.Random(0), count, numel)
        t0 = time.monotonic()
        for frames in messages:
            fuzzer.send_multipart(frames)
            assert fuzzer.poll(5000), f"no reply to {frames!r:.200}"
            reply = wire.decode(fuzzer.recv_multipart())
            assert reply.op == "error", frames
        assert time.monotonic() - t0 < 30
        big.send_multipart([b"x" * (wire.CHUNK + wire.MAX_HEADER + 1)])   # over MAXMSGSIZE: dropped
        now = torch.empty(numel)
        w0.exchange([[Request({"op": "fetch"}, into=now)]])
        assert torch.equal(now, base), "a refused message changed the parameters"
        # a normal worker is still served: its gradient (or delta) is applied
        g0 = torch.randn(numel)
        w0.exchange([[Request({"op": "push", "step": 0, "version": 0, "offset": 0}, g0),
                      Request({"op": "pull", "step": 1, "want": "float32"}, into=now)]])
        expected = {"sync": init - 0.5 * (g1 + g0) / 2, "async": base - 0.5 * g0, "ssp": base - 0.5 * g0,
                    "geo": base + g0, "geo-barrier": init + g1 + g0}[mode]
        torch.testing.assert_close(now, expected)
        detail = services.finish()["servers_detail"][0]
        assert detail["rejected"] == len(messages) and detail["version"] == (1 if mode in ("sync", "geo-barrier")
                                                                              else 2)
    finally:
        for c in (w0, w1):
            c.close()
        fuzzer.close(linger=0)
        big.close(linger=0)
        zctx.term()
        services.stop()


class Raw:
    """One DEALER speaking the wire directly to a server, for requests a PSClient would never send."""

    def __init__(self, zctx: zmq.Context, address: str) -> None:
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, header: dict, tensor: torch.Tensor | None = None) -> None:
        self.sock.send_multipart(wire.encode(header, tensor))

    def reply(self, timeout_ms: int = 5000) -> wire.Message | None:
        return wire.decode(self.sock.recv_multipart()) if self.sock.poll(timeout_ms) else None

    def ask(self, header: dict, tensor: torch.Tensor | None = None) -> wire.Message:
        self.send(header, tensor)
        r = self.reply()
        assert r is not None, f"no reply to {header}"
        return r


@pytest.fixture
def server():
    """server(mode, precision, workers, servers, **backend) -> (services, numel); everything stopped after."""
    started, zctx = [], zmq.Context()

    def make(mode: str, precision: str = "fp32", workers: int = 2, servers: int = 1, **extra):
        cfg = from_dict(config("srv", train={"optimizer": "sgd", "lr": 0.5, "precision": precision},
                               workload={"model": "mlp"}, backend=ps(workers, mode, servers, **extra)))
        started.append(start_services(cfg, None, threads=True))
        return started[-1], sum(p.numel() for p in build_workload(cfg).model.parameters())

    make.raw = lambda address: Raw(zctx, address)
    yield make
    for s in started:
        s.stop()
    zctx.destroy(linger=0)


def _fetch(raw: Raw) -> torch.Tensor:
    r = raw.ask({"op": "fetch", "worker": 0})
    assert r.op == "params", r.header
    return r.tensor().clone()


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_fp16_pushes_with_a_bad_loss_scale_are_refused(server, mode):
    """A loss scale of 0 once crashed an async server (ZeroDivisionError). A scale must be a power of two
    >= 1 (in sync: the server's own, 2^16 at first); found_inf = false with inf in the gradient is a lie."""
    services, numel = server(mode, "fp16")
    raw = server.raw(services.info["addresses"][0])
    before = _fetch(raw)
    g = torch.full((numel,), 0.5, dtype=torch.float16)
    push = {"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0}
    bad = [dict(push, scale=s, found_inf=False) for s in (0.0, 0, -1.0, 1e-300, 3.0, 0.5, 2.0**-3)]
    bad.append(dict(push, found_inf=False))                               # no scale at all
    if mode == "sync":
        bad.append(dict(push, scale=2.0**15, found_inf=False))            # not the server's scale
    for header in bad:
        r = raw.ask(header, g)
        assert r.op == "error" and "scale" in r.header["message"], (header, r.header)
    inf = g.clone()
    inf[3] = float("inf")
    r = raw.ask(dict(push, scale=2.0**16, found_inf=False), inf)
    assert r.op == "error" and "inf/nan" in r.header["message"]
    assert torch.equal(_fetch(raw), before)
    r = raw.ask(dict(push, scale=2.0**16, found_inf=False), g)           # the server still serves
    assert r.op == "ack", r.header
    if mode != "sync":   # applied at once: -lr * g (scale 2^16 unscaled by the same 2^16)
        torch.testing.assert_close(_fetch(raw), before - 0.5 * g.float() / 2**16)


def test_a_bug_in_a_handler_is_answered_logged_and_fails_the_server_only_if_state_changed(server, capsys):
    """A last resort: an unexpected exception gets an `internal error` reply and a traceback on stderr
    instead of ending the serve loop. Before the state changed the server goes on; after (here: the
    optimizer step raising mid-update) it fails, rather than serve parameters it cannot trust."""
    import threading

    from psarch.ps.layout import initial_flat
    from psarch.ps.server import ParameterServer

    cfg = from_dict(config("bug", train={"optimizer": "sgd", "lr": 0.5}, workload={"model": "mlp"},
                           backend=ps(2, "async")))
    srv = ParameterServer(0, cfg)
    srv.initialize(initial_flat(cfg))
    srv._on_fetch = lambda ident, msg: 1 / 0                    # a bug before any change
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    raw = server.raw(srv.address)
    try:
        r = raw.ask({"op": "fetch", "worker": 0})
        assert r.op == "error" and "internal error: ZeroDivisionError" in r.header["message"]
        g = torch.randn(srv.hi - srv.lo)
        assert raw.ask({"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0}, g).op == "ack"
        assert srv.failure is None and srv.state.version == 1
        srv.state.optim.optimizer.step = lambda: 1 / 0             # a bug in the middle of an update
        r = raw.ask({"op": "push", "worker": 1, "step": 0, "version": 0, "offset": 0}, g)
        assert r.op == "error" and "internal error: ZeroDivisionError" in r.header["message"]
        assert srv.failure is not None and "while applying 'push' of worker 1" in srv.failure
        r = raw.ask({"op": "pull", "worker": 0, "step": 1, "want": "float32"})
        assert r.op == "error" and "internal error" in r.header["message"]   # every later request hears it
        assert thread.is_alive()
    finally:
        srv.stop()
        thread.join(5)
    err = capsys.readouterr().err
    assert err.count("Traceback") == 2 and "internal error handling 'push' of worker 1" in err


def test_a_worker_waits_for_one_pull_at_a_time(server):
    """sync: worker 1's pull for step 1 waits for worker 0; a second one is refused at once (the waiting
    queue cannot grow), and the first is answered when the round completes."""
    services, numel = server("sync")
    addr = services.info["addresses"][0]
    w0, w1 = server.raw(addr), server.raw(addr)
    g0, g1 = torch.randn(numel), torch.randn(numel)
    before = _fetch(w0)
    assert w1.ask({"op": "push", "worker": 1, "step": 0, "version": 0, "offset": 0}, g1).op == "ack"
    w1.send({"op": "pull", "worker": 1, "step": 1, "want": "float32"})
    assert w1.reply(300) is None                                   # waits for worker 0's gradient
    r = w1.ask({"op": "pull", "worker": 1, "step": 1, "want": "float32"})
    assert r.op == "error" and "already has a pull waiting" in r.header["message"]
    r = w1.ask({"op": "pushpull", "worker": 1, "step": 1, "version": 0, "offset": 0}, g1)
    assert r.op == "error"
    assert w0.ask({"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0}, g0).op == "ack"
    r = w1.reply()
    assert r is not None and r.op == "params" and r.header["version"] == 1
    torch.testing.assert_close(r.tensor(), before - 0.5 * (g0 + g1) / 2)


def test_dc_asgd_compensates_a_stale_gradient_of_a_second_worker(server):
    """Two workers pull w0; worker 0's gradient moves the parameters to w1; worker 1's gradient (stale by
    one) is compensated: w1 - lr·(g + λ·g⊙g⊙(w1 − w0)), with w1 − w0 = −lr·g_0 ≠ 0. Two servers, each
    compensating its own range with what it last sent worker 1; λ = 0 gives plain async (the term matters)."""
    lam, lr = 0.5, 0.5
    results = {}
    for lam_ in (lam, 0.0):
        services, numel = server("async", servers=2, staleness_compensation="dc", dc_lambda=lam_)
        client = {w: PSClient(services.info["addresses"], w, 10.0) for w in (0, 1)}
        try:
            w0 = torch.empty(numel)
            for w in (0, 1):   # both pull version 0
                client[w].exchange([[Request({"op": "pull", "step": 0, "want": "float32"}, into=w0[lo:hi])]
                                    for lo, hi in server_ranges(numel, 2)])
            g0 = torch.randn(numel, generator=torch.Generator().manual_seed(1))
            g1 = 4 * torch.randn(numel, generator=torch.Generator().manual_seed(2))
            for w, g in ((0, g0), (1, g1)):
                if w == 1:  # the server is the authority on staleness: claiming a fresher version is refused
                    lo, hi = server_ranges(numel, 2)[0]
                    with pytest.raises(PSError, match="says it computed on version 1, this server last sent it "
                                                      "version 0"):
                        client[1].exchange([[Request({"op": "push", "step": 0, "version": 1, "offset": lo},
                                                     g[lo:hi])], []])
                # worker 0 pulls again after its push: only worker 1's own record (w0) may be used for it
                reqs = [[Request({"op": "push", "step": 0, "version": 0, "offset": lo}, g[lo:hi]),
                         Request({"op": "pull", "step": 1, "want": "float32"}, into=torch.empty(hi - lo))]
                        for lo, hi in server_ranges(numel, 2)]
                client[w].exchange(reqs)
                assert [r[0].reply["staleness"] for r in reqs] == [w, w]
            final = torch.empty(numel)
            client[0].exchange([[Request({"op": "fetch"}, into=final[lo:hi])] for lo, hi in server_ranges(numel, 2)])
            results[lam_] = final
        finally:
            for c in client.values():
                c.close()
    w1 = w0 - lr * g0
    torch.testing.assert_close(results[lam], w1 - lr * (g1 + lam * g1 * g1 * (w1 - w0)))
    torch.testing.assert_close(results[0.0], w1 - lr * g1)
    assert (results[lam] - results[0.0]).abs().max() > 1e-3, "the compensation term did not matter"


@pytest.mark.parametrize("barrier", [True, False])
def test_geo_after_a_lost_worker_moves_by_the_mean_delta_of_the_others(server, barrier):
    """Workers push delta/N; with worker 2 of 3 lost the server scales the deltas by N/2, so the model
    moves by the mean of the two deltas left (not by 2/3 of it). Pushes of a lost worker are refused."""
    services, numel = server("geo", workers=3, geo_barrier=barrier)
    addr = services.info["addresses"][0]
    raw = {w: server.raw(addr) for w in range(3)}
    before = _fetch(raw[0])
    services.worker_lost(2, "killed by the test")
    time.sleep(0.3)   # the launcher's pipe is read between requests
    d = [torch.randn(numel) for _ in range(2)]
    r = raw[2].ask({"op": "push", "worker": 2, "step": 0, "version": 0, "offset": 0}, d[0] / 3)
    assert r.op == "error" and "lost" in r.header["message"]
    for w in (0, 1):
        assert raw[w].ask({"op": "push", "worker": w, "step": 0, "version": 0, "offset": 0}, d[w] / 3).op == "ack"
    torch.testing.assert_close(_fetch(raw[0]), before + (d[0] + d[1]) / 2)


# ---------------------------------------------------------------- launched runs (server processes)

def dies_on_rank1_at_step3(cfg) -> psarch.Workload:
    """A tiny GPT whose rank 1 process dies abruptly when it fetches the batch of step 3."""
    return _with_batch_hook(cfg, lambda step, shard: os._exit(3) if (shard, step) == (1, 3) else None)


def dies_on_rank1_at_step3_rank0_pauses_at_step5(cfg) -> psarch.Workload:
    """Rank 1 dies at step 3; rank 0 (which ssp holds at step 5 until rank 1 is lost) then pauses 0.5 s:
    the silence of a worker the server kept waiting counts from its release, not from its last message."""
    def hook(step: int, shard: int) -> None:
        if (shard, step) == (1, 3):
            os._exit(3)
        if (shard, step) == (0, 5):
            time.sleep(0.5)
    return _with_batch_hook(cfg, hook)


def dies_on_rank0_at_step3(cfg) -> psarch.Workload:
    return _with_batch_hook(cfg, lambda step, shard: os._exit(3) if (shard, step) == (0, 3) else None)


def hangs_on_rank1_at_step3(cfg) -> psarch.Workload:
    return _with_batch_hook(cfg, lambda step, shard: time.sleep(3600) if (shard, step) == (1, 3) else None)


def slow_rank1(cfg) -> psarch.Workload:
    return _with_batch_hook(cfg, lambda step, shard: time.sleep(0.05) if shard == 1 else None)


def _with_batch_hook(cfg, hook) -> psarch.Workload:
    wl = build_workload(from_dict(dict(json.loads(json.dumps(TINY_GPT)), train=cfg.to_dict()["train"])))

    def batch(step: int, shard: int, num_shards: int):
        hook(step, shard)
        return wl.batch(step, shard, num_shards)

    return psarch.Workload(wl.model, wl.loss_fn, batch, wl.entropy_floor, "tiny-gpt-with-hook")


def _children() -> list[str]:
    """Processes whose parent is this one (multiprocessing's resource tracker excepted)."""
    me, found = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me and "resource_tracker" not in cmd:
            found.append(f"{pid}: {cmd[:120]}")
    return found


def launch(tmp_path: Path, name: str, **sections) -> tuple[dict, Path]:
    cfg = from_dict(config(name, **sections))
    out = tmp_path / name
    summary = psarch.run(cfg, out, echo=False)
    assert _children() == [], "orphan processes after the run"
    return summary, out


def test_end_to_end_sync_run_writes_server_traffic_and_a_loadable_model(tmp_path):
    summary, out = launch(tmp_path, "e2e", train=OPTIMIZERS["adamw"], backend=ps(2, servers=2))
    on_disk = json.loads((out / "summary.json").read_text())
    servers = on_disk["traffic"]["servers"]
    assert [s["server"] for s in servers] == [0, 1] and all(s["sent"] > 0 and s["received"] > 0 for s in servers)
    workers = on_disk["traffic"]["per_rank"]
    assert sum(s["received"] for s in servers) == sum(w["sent"] for w in workers)
    assert sum(s["sent"] for s in servers) == sum(w["received"] for w in workers)
    assert on_disk["variant"] == "sync" and on_disk["servers"] == 2 and on_disk["lost_workers"] == []
    assert [m["optimizer"] for m in on_disk["memory"]["per_rank"]] == [0, 0]
    plain = build_workload(from_dict(TINY_GPT)).model
    plain.load_state_dict(torch.load(out / "model.pt", weights_only=True))   # strict: every key, every shape
    single = run_rank(from_dict(config("ref", train=OPTIMIZERS["adamw"])), DistContext(), echo=False)
    assert_same_model(torch.load(out / "model.pt", weights_only=True), single["model_state"], "e2e ps vs single")


def test_async_four_workers_converge_with_stale_gradients(tmp_path):
    summary, _ = launch(tmp_path, "async4", train={"optimizer": "adamw", "lr": 1e-2, "steps": 40, "global_batch": 16},
                        backend=ps(4, "async"))
    hist = {int(k): v for k, v in summary["staleness"]["histogram"].items()}
    assert sum(hist.values()) == 4 * 40
    assert sum(v for k, v in hist.items() if k > 0) > 0, f"no stale update at all: {hist}"
    rows = [json.loads(x) for x in (tmp_path / "async4" / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.3, f"async PS did not converge: {first:.3f} -> {last:.3f}"


def test_ssp_no_worker_runs_more_than_the_bound_ahead(tmp_path):
    bound = 1
    summary, out = launch(tmp_path, "ssp", workload={"factory": "test_ps:slow_rank1"},
                          train={"optimizer": "sgd", "lr": 0.05, "steps": 10},
                          backend=ps(2, "ssp", staleness_bound=bound))
    ssp = summary["ssp"]
    assert ssp["max_ahead"] == bound, "the bound never bound (rank 1 is slow) or was broken"
    # replay the server's own record: a worker was let into step c only when every live worker had pushed
    # at least c - bound steps
    pushed, grants = [0, 0], 0
    for kind, worker, step in json.loads((out / ssp["trace_file"]).read_text()):
        if kind == 0:
            assert step == pushed[worker] + 1
            pushed[worker] = step
        else:
            assert step - min(pushed) <= bound, (worker, step, pushed)
            grants += 1
    assert pushed == [10, 10] and grants == 2 * 11   # the initial pull and one per step
    # and the workers' own rows say the same
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    aheads = [w["ahead"] for r in rows for w in r["workers"]]
    assert len(aheads) == 20 and max(aheads) <= bound


@pytest.mark.parametrize("mode, extra, dead", [("async", {}, 0), ("geo", {"k_steps": 2, "geo_barrier": True}, 1),
                                               ("ssp", {"staleness_bound": 1}, 1)])
def test_a_dead_worker_does_not_stop_async_modes(tmp_path, mode, extra, dead):
    """The run finishes without the dead rank; model.pt comes from the servers (rank 0 dies in async)."""
    summary, out = launch(tmp_path, f"dies-{mode}", workload={"factory": f"test_ps:dies_on_rank{dead}_at_step3"},
                          train={"optimizer": "sgd", "lr": 0.1, "steps": 8},
                          backend=ps(2, mode, timeout_s=30.0, **extra))
    assert [w["rank"] for w in summary["lost_workers"]] == [dead]
    assert "exited with code 3" in summary["lost_workers"][0]["error"]
    assert summary["steps"] == 8 and [m["rank"] for m in summary["memory"]["per_rank"]] == [1 - dead]
    state = torch.load(out / "model.pt", weights_only=True)
    build_workload(from_dict(TINY_GPT)).model.load_state_dict(state)
    versions = [d["version"] for d in summary["servers_detail"]]
    assert versions == [{"async": 3 + 8, "ssp": 3 + 8, "geo": 8 // 2}[mode]]   # every surviving push landed


def test_sync_stops_with_an_error_naming_a_dead_worker(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RunError, match="rank 1"):
        launch(tmp_path, "sync-dies", workload={"factory": "test_ps:dies_on_rank1_at_step3"},
               train={"optimizer": "sgd", "steps": 8}, backend=ps(2, timeout_s=3.0))
    assert time.monotonic() - t0 < 120   # start-up included, on a busy 2-core machine; a hang never ends
    assert _children() == []


def test_sync_stops_with_an_error_naming_a_hung_worker_after_timeout(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RunError, match=r"no gradients from worker\(s\) \[1\] within backend.timeout_s = 3 s"):
        launch(tmp_path, "sync-hangs", workload={"factory": "test_ps:hangs_on_rank1_at_step3"},
               train={"optimizer": "sgd", "steps": 8}, backend=ps(2, timeout_s=3.0))
    assert 3 <= time.monotonic() - t0 < 120
    assert _children() == []


def test_standalone_server_serves_workers_that_find_it_through_the_config(tmp_path):
    """`psarch server` (its own process, port 0 = any free port) + a worker given backend.server_addresses."""
    import subprocess
    import sys

    toml = tmp_path / "remote.toml"
    toml.write_text('seed = 3\n[workload]\nseq_len = 8\n[workload.gpt]\nn_layer = 1\nn_embd = 16\nn_head = 2\n'
                    '[workload.markov]\nvocab_size = 16\nbranching = 3\n'
                    '[train]\nsteps = 4\nglobal_batch = 12\noptimizer = "sgd"\nlr = 0.1\nlog_every = 100\n'
                    '[backend]\nkind = "ps"\nmode = "async"\ntimeout_s = 20.0\n')
    proc = subprocess.Popen([sys.executable, "-m", "psarch.cli", "server", str(toml), "--index", "0", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on tcp://127.0.0.1:" in line, line + proc.stderr.read()
        address = line.split()[-1]
        summary = psarch.run(toml, tmp_path / "remote", overrides=[f'backend.server_addresses=["{address}"]'],
                             echo=False)
        assert summary["steps"] == 4
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["version"] == 4 and stats["received"] == summary["traffic"]["per_rank"][0]["sent"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_standalone_server_goes_on_without_a_silent_worker_and_exits(tmp_path, mode):
    """Across machines no launcher tells a `psarch server` that a worker died: after backend.timeout_s
    without a message from it the server counts it lost, the survivor finishes (in ssp without waiting
    for the timeout to fail the run), and the server exits by itself once every worker is done or lost."""
    import subprocess
    import sys

    toml = tmp_path / "remote.toml"
    toml.write_text('seed = 3\n[workload]\nfactory = "test_ps:dies_on_rank1_at_step3_rank0_pauses_at_step5"\n'
                    '[train]\nsteps = 8\nglobal_batch = 12\noptimizer = "sgd"\nlr = 0.1\nlog_every = 100\n'
                    f'[backend]\nkind = "ps"\nworld_size = 2\nmode = "{mode}"\nstaleness_bound = 1\n'
                    'timeout_s = 3.0\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "psarch.cli", "server", str(toml), "--index", "0", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on tcp://127.0.0.1:" in line, line + proc.stderr.read()
        summary = psarch.run(toml, tmp_path / "remote", echo=False,
                             overrides=[f'backend.server_addresses=["{line.split()[-1]}"]'])
        assert summary["steps"] == 8 and [w["rank"] for w in summary["lost_workers"]] == [1]
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)   # no `done` will ever come from worker 1
        assert proc.returncode == 0, err
        assert time.monotonic() - t0 < 30
        assert "worker 1 lost: no message from it for more than 3 s (backend.timeout_s)" in err
        assert "worker 0 lost" not in err
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["lost"] == [1] and stats["failure"] is None and stats["version"] == 3 + 8
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
