"""The embedding rows' wire (keyed messages) and a row server's refusals: every malformed or out-of-turn
rowpull / rowpush gets an error reply and changes nothing, then a normal worker is served. No spawned
processes: servers are threads of the test process, spoken to over raw DEALER sockets."""
from __future__ import annotations

import random
import threading

import msgpack
import pytest
import torch
import zmq

from psarch.config import Config, from_dict
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from psarch.ps.worker.client import PSClient, Request
from psarch.ps.errors import PSError
from psarch.ps.layout import server_ranges
from psarch.ps.rows import dense_params
from psarch.ps.services import start_services
from psarch.workload import build_workload
from ps_setup import config, ps

DIM, ROWS, TABLES = 4, 50, 2        # keys 0..99; server 0 of 2 owns the even ones


def _cfg(name: str, backend: dict) -> Config:
    """A tiny dlrm run (2 tables x 50 rows x dim 4) with row-wise SGD at lr 0.5 on `backend`."""
    return from_dict(config(name, base={"seed": 1, "workload": {
        "model": "dlrm", "data": "clicks", "dlrm": {"num_tables": TABLES, "rows": ROWS, "dim": DIM, "bottom_mlp": [4],
                                                     "top_mlp": [4]}, "clicks": {"dense": 3}},
        "train": {"steps": 1, "global_batch": 4}}, train={"optimizer": "sgd", "lr": 0.5}, backend=backend))


def _rowfetch(client: PSClient) -> torch.Tensor:
    """Server 0's rows (in its local order)."""
    req = Request({"op": "rowfetch"})
    client.exchange([[req]] + [[] for _ in client.addresses[1:]])
    return req.into.clone()


def _keyed(keys: torch.Tensor, values: torch.Tensor, **header) -> list[bytes]:
    h = dict({"op": "rowpush", "worker": 0, "step": 0, "version": 0}, **header)
    return [bytes(f) for f in wire.encode(h, values, keys)]


def test_keyed_roundtrip_and_large_keys_split_into_chunks():
    keys = torch.arange(0, 2 * (wire.CHUNK // 8) + 5, dtype=torch.int64)   # 3 frames of keys
    values = torch.randn(keys.numel(), 1)
    frames = _keyed(keys, values)
    assert msgpack.unpackb(frames[0])["keys"] == keys.numel() and len(frames) == 1 + 3 + 2   # header, keys, values (CHUNK + 20 bytes)
    msg = wire.decode(frames)
    assert torch.equal(msg.keys(), keys) and torch.equal(msg.tensor(), values)
    empty = wire.decode(_keyed(torch.empty(0, dtype=torch.int64), torch.empty(0, 3)))
    assert empty.keys().numel() == 0 and empty.tensor().shape == (0, 3)


def _with(frames: list[bytes], **over) -> list[bytes]:
    h = msgpack.unpackb(frames[0])
    for k, v in over.items():
        h.pop(k) if v is KeyError else h.__setitem__(k, v)
    return [msgpack.packb(h), *frames[1:]]


GOOD = _keyed(torch.tensor([0, 2, 4]), torch.ones(3, DIM))


@pytest.mark.parametrize("frames, match", [
    (_with(GOOD, keys=KeyError), "field 'keys'"),
    (_with(GOOD, keys=-1), "field 'keys'"),
    (_with(GOOD, keys=2), "2 keys are 16 bytes"),
    (_with(GOOD, keys=4), "4 keys are 32 bytes"),
    (_with(GOOD, shape=[2, DIM * 3 // 2]), "3 keys and values of shape \\[2, 6\\]"),
    (_with(GOOD, shape=[3 * DIM]), "expected \\[3, dim\\]"),
    (GOOD[:2], "announces 1 payload frame\\(s\\), 0 arrived"),
    (_with([msgpack.packb({"op": "rowpull", "worker": 0, "step": 0, "want": "float32", "keys": 1}), b"x" * 8]),
     "unexpected field 'keys'"),
])
def test_decode_rejects_malformed_keyed_messages(frames, match):
    with pytest.raises(wire.WireError, match=match):
        wire.decode(frames)


def test_encode_refuses_keys_that_are_not_int64_of_one_dimension():
    for keys in (torch.tensor([0, 1], dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int64)):
        with pytest.raises(wire.WireError, match="expected int64 of one dimension"):
            wire.encode({"op": "rowpush", "worker": 0, "step": 0, "version": 0}, torch.ones(2, DIM), keys)


def _bad_requests(rng: random.Random, count: int) -> list[list[bytes]]:
    """Requests server 0 (even keys 0..98, dim 4) must refuse; worker 1 has pushed its rows of step 0."""
    def pull(keys, dtype=torch.int64, **h):
        return [bytes(f) for f in wire.encode(dict({"op": "rowpull", "worker": 0, "step": 0, "want": "float32"}, **h),
                                              torch.tensor(keys).to(dtype))]

    def push(keys, values=None, **h):
        k = torch.tensor(keys, dtype=torch.int64)
        return _keyed(k, torch.ones(k.numel(), DIM) if values is None else values, **h)

    kinds = [
        lambda: pull([0, 2, rng.choice([100, 102, 10**9])]),                 # out of range
        lambda: pull([-2, 0]),
        lambda: pull([2, 2, 4]),                                             # duplicates
        lambda: pull([4, 2]),                                                # not sorted
        lambda: pull([1, 2]),                                                # server 1's key
        lambda: pull([0, 2], rng.choice([torch.int32, torch.float64, torch.uint8])),   # wrong dtype
        lambda: [bytes(f) for f in wire.encode({"op": "rowpull", "worker": 0, "step": 0, "want": "float32"},
                                               torch.zeros(2, 2, dtype=torch.int64))],   # 2-D keys
        lambda: pull([0, 2], want=rng.choice(["float16", "x"])),
        lambda: push([0, 2, 2]),
        lambda: push([0, 2, 3]),
        lambda: push([0, 200]),
        lambda: push([0, 2], torch.ones(2, DIM + 1)),                         # wrong dim
        lambda: push([0, 2], torch.ones(2, DIM, dtype=torch.float64)),        # wrong dtype
        lambda: push([0, 2], torch.tensor([[1.0, float("nan"), 0, 0], [0, 0, 0, 0]])),
        lambda: push([0, 2], step=rng.randint(1, 9)),                        # not its next step
        lambda: push([0, 2], version=rng.randint(1, 9)),
        lambda: push([0, 2], worker=1),                                      # worker 1 pushed its rows of step 0
        lambda: push([0], worker=rng.randint(2, 50)),
        lambda: _with(push([0, 2]), keys=3),                                  # mismatched lengths
        lambda: [msgpack.packb({"op": "rowfetch", "worker": 7})],
    ]
    return [rng.choice(kinds)() for _ in range(count)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bad_row_requests_are_refused_and_change_nothing(mode):
    cfg = _cfg("rowfuzz", ps(2, mode, servers=2, embeddings="rows"))
    services = start_services(cfg, None, threads=True)
    addr, creds = services.info.addresses, services.info.auth
    zctx = zmq.Context()
    socks = {}
    w0, w1 = PSClient(addr, 0, 10.0, creds), PSClient(addr, 1, 10.0, creds)
    try:
        for w in (0, 1):
            socks[w] = zctx.socket(zmq.DEALER)
            socks[w].setsockopt(zmq.LINGER, 0)
            auth.client_socket(socks[w], Credentials.from_dict(creds), w, 0)
            socks[w].connect(addr[0])

        init = _rowfetch(w0)
        g1 = torch.randn(2, DIM)
        w1.exchange([[Request({"op": "rowpush", "step": 0, "version": 0}, g1, keys=torch.tensor([0, 6]))], []])
        base = _rowfetch(w0)
        for frames in _bad_requests(random.Random(0), 300):
            h = msgpack.unpackb(frames[0])
            sock = socks.get(h.get("worker"), socks[0])
            sock.send_multipart(frames)
            assert sock.poll(5000), f"no reply to {frames!r:.200}"
            assert wire.decode(sock.recv_multipart()).op == "error", h
        assert torch.equal(_rowfetch(w0), base), "a refused request changed the rows"
        # a well-formed rowpull is answered with the rows asked for, in the keys' order
        pulled = Request({"op": "rowpull", "step": 0, "want": "float32"}, torch.tensor([0, 6, 98]))
        w0.exchange([[pulled], []])
        torch.testing.assert_close(pulled.into, base[[0, 3, 49]])
        # worker 0's rows are applied: at once (async), or summed with worker 1's when the round ends (sync)
        g0 = torch.randn(2, DIM)
        w0.exchange([[Request({"op": "rowpush", "step": 0, "version": 0}, g0, keys=torch.tensor([6, 8]))], []])
        want = base.clone()
        if mode == "async":
            want[[3, 4]] -= 0.5 * g0
        torch.testing.assert_close(_rowfetch(w0), want)
        if mode == "sync":   # the dense pushes of both workers end the round: the mean of the rows is applied
            numel = sum(p.numel() for p in dense_params(build_workload(cfg).model))
            for w, client in ((1, w1), (0, w0)):
                client.exchange([[Request({"op": "push", "step": 0, "version": 0, "offset": lo}, torch.zeros(hi - lo))]
                                 for lo, hi in server_ranges(numel, 2)])
            want = init.clone()
            want[[0, 3]] -= 0.5 * g1 / 2
            want[[3, 4]] -= 0.5 * g0 / 2
            torch.testing.assert_close(_rowfetch(w0), want)
    finally:
        for c in (w0, w1):
            c.close()
        for s in socks.values():
            s.close(linger=0)
        zctx.term()
        services.stop()


def test_sync_refuses_rows_for_the_next_step_while_the_round_waits():
    """A worker whose dense push of round s is in may not push rows for step s + 1 before the round ends:
    they would be summed into round s (here row 0 would move by the whole gradient, not its mean)."""
    cfg = _cfg("rowturn", ps(2, "sync", servers=1, embeddings="rows"))
    services = start_services(cfg, None, threads=True)
    addr, creds = services.info.addresses, services.info.auth
    w0, w1 = PSClient(addr, 0, 10.0, creds), PSClient(addr, 1, 10.0, creds)
    numel = sum(p.numel() for p in dense_params(build_workload(cfg).model))

    def rowpush(step: int) -> Request:
        return Request({"op": "rowpush", "step": step, "version": 0}, torch.ones(1, DIM), keys=torch.tensor([0]))

    try:
        init = _rowfetch(w0)
        w0.exchange([[rowpush(0)]])
        w0.exchange([[Request({"op": "push", "step": 0, "version": 0, "offset": 0}, torch.zeros(numel))]])
        with pytest.raises(PSError, match="rows for step 1 during the round of step 0, after its dense push"):
            w0.exchange([[rowpush(1)]])
        w1.exchange([[Request({"op": "push", "step": 0, "version": 0, "offset": 0}, torch.zeros(numel))]])
        torch.testing.assert_close(_rowfetch(w0)[0], init[0] - 0.5 * 1 / 2)   # lr x the mean over 2 workers
    finally:
        w0.close()
        w1.close()
        services.stop()


def test_the_handler_table_answers_every_request_op_once():
    """Requests dispatch through one table: a server with rows has a handler for every request op of the wire
    (init refused), a dense server for every one but the row ops; a row server must be given its rows."""
    from psarch.ps.server.parameter_server import ParameterServer
    requests = set(wire.REPLY_TO)
    none = Credentials("none")
    with_rows = ParameterServer(0, _cfg("table", ps(2, "sync", servers=1, embeddings="rows")), creds=none)
    dense = ParameterServer(0, _cfg("table", ps(2, "sync", servers=1)), creds=none)
    try:
        assert set(with_rows.handlers) == requests
        assert set(dense.handlers) == requests - {"rowpull", "rowpush", "rowfetch"}
        with pytest.raises(PSError, match="builds its initial model from the config"):
            with_rows.handlers["init"](b"w0", None)
        with pytest.raises(ValueError, match="starts from its rows of the tables too"):
            with_rows.initialize(torch.zeros(40))
    finally:
        with_rows.close()
        dense.close()


def test_geo_barrier_forgets_the_rows_of_a_worker_lost_before_its_dense_push():
    """GEO with barrier: worker 1 pushes row deltas, then is lost before its dense push; the round ends with
    worker 0 alone, and worker 1's rows must leave it as its dense delta does (driven by handle(), no thread)."""
    from psarch.ps.server.start import row_server
    cfg = _cfg("rowlost", ps(2, "geo", servers=1, embeddings="rows", geo_barrier=True, k_steps=1))
    srv = row_server(0, cfg, "127.0.0.1", 0, creds=Credentials("none"))
    try:
        init = srv.rows.shard.rows.clone()
        d0, d1 = torch.ones(1, DIM), 100 * torch.ones(1, DIM)
        srv.handle([b"w0", *_keyed(torch.tensor([0]), d0, worker=0)])
        numel = srv.state.size
        srv.handle([b"w0", *[bytes(f) for f in wire.encode(
            {"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0}, torch.zeros(numel))]])
        srv.handle([b"w1", *_keyed(torch.tensor([0]), d1, worker=1)])
        assert srv.state.rejected == 0 and srv.state.parts[0].range.version == 0
        srv.lose(1, "silent")
        assert srv.state.parts[0].range.version == 1, "the round did not end without the lost worker"
        # the mean over the live worker: d0 x N/1
        torch.testing.assert_close(srv.rows.shard.rows[0], init[0] + 2 * d0[0])
    finally:
        srv.close()



def test_a_rows_reply_of_other_rows_than_asked_is_a_one_line_error():
    """A server (here a fake one) that answers a rowpull of 2 keys with 3 rows: the worker says so in a PSError."""
    zctx = zmq.Context()
    fake = zctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        ident = fake.recv_multipart()[0]
        fake.send_multipart([ident, *wire.encode({"op": "rows", "version": 0}, torch.ones(3, DIM))])

    server = threading.Thread(target=answer, daemon=True)
    server.start()
    client = PSClient([f"tcp://127.0.0.1:{port}"], 0, 5.0, Credentials("none"))
    try:
        req = Request({"op": "rowpull", "step": 0, "want": "float32"}, torch.tensor([0, 2]), into=torch.empty(2, DIM))
        with pytest.raises(PSError, match="bad reply from server 0 to 'rowpull': .*payload is float32 \\[3, 4\\]"):
            client.exchange([[req]])
    finally:
        server.join(5)
        client.close()
        fake.close(linger=0)
        zctx.term()
