"""No one locks a worker out of a server: strangers whose handshakes fail hold no slot however long they stay
(PLAIN with a wrong password, CURVE with any key the server does not list), and one worker's credentials hold
at most backend.max_connections_per_worker connections, so an insider cannot keep the others out either.
An insider's `save` of a step that is not the run's checkpoint step is refused and harms no one. Servers are
threads of the test process on loopback."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from psarch.checkpoint.writer import tmp_dir
from psarch.config import from_dict
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from psarch.ps.layout import initial_flat
from psarch.ps.server.parameter_server import ParameterServer
from ps_setup import config, ps
from zmtp_raw import RawPeer


@pytest.fixture
def serve(tmp_path):
    """serve(mechanism, **backend) -> (server, creds): a ParameterServer thread, 2 workers, keys in tmp_path."""
    started, keys = [], auth.keygen(tmp_path / "keys", 2, 1)

    def make(mechanism: str, train: dict | None = None, **extra) -> tuple[ParameterServer, Credentials]:
        cfg = from_dict(config("lockout", train={"optimizer": "sgd", "lr": 0.5, **(train or {})},
                               workload={"model": "mlp"},
                               backend=ps(2, "async", auth=mechanism, keys=str(keys), **extra)))
        creds = Credentials(mechanism, str(keys))
        flat = initial_flat(cfg)
        srv = ParameterServer(0, cfg, creds=creds, numel=flat.numel(), checkpoints=tmp_path / "checkpoints")
        srv.initialize(flat)
        thread = threading.Thread(target=srv.serve, daemon=True)
        thread.start()
        started.append((srv, thread))
        return srv, creds

    yield make
    for srv, thread in started:
        srv.stop()
        thread.join(5)


class Worker:
    """A DEALER authenticated as `worker` (or with a stranger's CURVE key: `stranger`)."""

    def __init__(self, zctx: zmq.Context, srv: ParameterServer, creds: Credentials, worker: int,
                 stranger: bool = False) -> None:
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        auth.client_socket(self.sock, creds, worker, 0)
        if stranger:
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
        self.sock.connect(srv.address)

    def ask(self, header: dict, wait_ms: int) -> wire.Message | None:
        self.sock.send_multipart(wire.encode(header))
        return wire.decode(self.sock.recv_multipart()) if self.sock.poll(wait_ms) else None


def _password(creds: Credentials, worker: int) -> str:
    return (Path(creds.folder) / f"worker{worker}.password").read_text().strip()


def _wait(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _fetch_from_each(workers: list[Worker], worker: int) -> None:
    """Every connection asks a fetch as `worker`, sending at once (a refused one queues nothing)."""
    for w in workers:
        w.sock.send_multipart(wire.encode({"op": "fetch", "worker": worker}), flags=zmq.NOBLOCK)


def _served(zctx: zmq.Context, srv: ParameterServer, creds: Credentials, worker: int) -> bool:
    """Whether a new connection of `worker` gets its fetch answered."""
    r = Worker(zctx, srv, creds, worker).ask({"op": "fetch", "worker": worker}, wait_ms=20000)
    return r is not None and r.op == "params"


def _answered(workers: list[Worker], settle_s: float = 1.0, limit_s: float = 20.0) -> int:
    """How many of `workers` have a reply waiting, once none has come for `settle_s` (at most `limit_s`)."""
    deadline, seen, since = time.monotonic() + limit_s, 0, time.monotonic()
    while time.monotonic() < deadline:
        n = sum(bool(w.sock.poll(0)) for w in workers)
        if n != seen:
            seen, since = n, time.monotonic()
        elif n and time.monotonic() - since > settle_s:
            break
        time.sleep(0.05)
    return seen


def test_failed_plain_handshakes_held_open_hold_no_slot(serve):
    """40 raw peers with a wrong PLAIN password that keep their connections open: ZeroMQ keeps each until
    backend.handshake_timeout_s (here 60 s), and once they filled max_connections (world_size + 16 = 18), so a
    worker connecting then was refused with ZAP 400 and never retried. Now they hold no slot: the worker is
    served while they are all still open."""
    srv, creds = serve("plain", handshake_timeout_s=60.0)
    strangers = []
    for _ in range(40):
        peer = RawPeer(srv.port, "0", "wrong")
        with pytest.raises(ConnectionError):
            peer.connect()
        strangers.append(peer)
    assert _wait(lambda: srv.connections.failed >= 40)
    zctx = zmq.Context()
    try:
        assert _served(zctx, srv, creds, 1)
        assert not any(p.closed_by_server(0.01) for p in strangers[-5:])   # (still open: they were the attack)
    finally:
        zctx.destroy(linger=0)
        for p in strangers:
            p.close()


def test_curve_strangers_who_know_the_server_key_hold_no_slot(serve):
    """Under CURVE anyone who knows the server's public key completes the key exchange; ZAP then refuses an
    unlisted client key. 40 such clients (ZeroMQ reconnects each and fails again) once filled the cap; now a
    listed worker is served among them."""
    srv, creds = serve("curve", handshake_timeout_s=60.0)
    zctx = zmq.Context()
    try:
        strangers = [Worker(zctx, srv, creds, 0, stranger=True) for _ in range(40)]
        for s in strangers:
            s.sock.send_multipart(wire.encode({"op": "fetch", "worker": 0}), flags=zmq.NOBLOCK)
        assert _wait(lambda: srv.zap.refused >= 40)
        assert _served(zctx, srv, creds, 1)
        assert not any(s.sock.poll(0) for s in strangers)
    finally:
        zctx.destroy(linger=0)


@pytest.mark.parametrize("silent", [True, False])
def test_one_worker_cannot_keep_another_out(serve, silent):
    """Worker 0's credentials opening 18 connections (silent after the handshake, or each asking a fetch) once
    took every slot, and worker 1 was refused. Now worker 0 holds at most max_connections_per_worker (2) and
    worker 1 is served."""
    srv, creds = serve("plain", handshake_timeout_s=60.0)
    zctx = zmq.Context()
    try:
        hoarders = [Worker(zctx, srv, creds, 0) for _ in range(18)]
        if not silent:
            _fetch_from_each(hoarders, 0)
        assert _wait(lambda: srv.zap.refused >= 16)
        if not silent:
            assert _answered(hoarders) == 2
        assert _served(zctx, srv, creds, 1)
    finally:
        zctx.destroy(linger=0)


def test_silent_connections_whose_slots_lapsed_cannot_build_up(serve):
    """Worker 0 opening two silent connections every handshake timeout (its slots lapse when no request
    proves them) once held 18 of them, then made all 18 speak: every slot was taken and worker 1 was refused.
    Now a first request that would take a worker past its cap drops its connection unanswered."""
    srv, creds = serve("plain", handshake_timeout_s=0.3)
    zctx = zmq.Context()
    try:
        hoarders = []
        for _ in range(5):
            hoarders += [Worker(zctx, srv, creds, 0) for _ in range(2)]
            time.sleep(0.5)
        _fetch_from_each(hoarders, 0)
        assert _wait(lambda: srv.connections.dropped["over_cap"] >= 8)
        assert _answered(hoarders) == 2
        assert _served(zctx, srv, creds, 1)
    finally:
        zctx.destroy(linger=0)


def test_a_flood_of_handshakes_does_not_hold_the_servers_loop(serve):
    """Two threads re-handshaking with worker 0's password as fast as they can: each refused handshake waited
    ~20 ms for the connection count in the server's own loop, which took them one after another, and worker 1
    got no answer until the flood stopped (14 s; a run failed). The ZAP handler now has a thread of its own:
    worker 1 is answered all through the flood."""
    srv, creds = serve("plain")
    stop = threading.Event()

    def flood() -> None:
        zctx = zmq.Context()
        try:
            while not stop.is_set():
                s = zctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                auth.client_socket(s, creds, 0, 0)
                s.connect(srv.address)
                time.sleep(0.002)
                s.close(0)
        finally:
            zctx.destroy(linger=0)

    zctx = zmq.Context()
    floods = [threading.Thread(target=flood) for _ in range(2)]
    try:
        worker = Worker(zctx, srv, creds, 1)
        assert worker.ask({"op": "fetch", "worker": 1}, wait_ms=20000) is not None
        for f in floods:
            f.start()
        assert _wait(lambda: srv.zap.refused >= 50)
        answered = sum(worker.ask({"op": "fetch", "worker": 1}, wait_ms=5000) is not None for _ in range(20))
        assert answered == 20
    finally:
        stop.set()
        for f in floods:
            f.join(10)
        zctx.destroy(linger=0)


def _push_once(w: "Worker", srv: ParameterServer, worker: int) -> None:
    """One push of zeros to every partition of the server, as worker `worker`'s first step."""
    for part in srv.state.parts:
        w.sock.send_multipart(wire.encode({"op": "push", "worker": worker, "step": 0, "version": 0,
                                           "offset": part.lo}, torch.zeros(part.hi - part.lo)))
    for _ in srv.state.parts:
        assert w.sock.poll(10000) and wire.decode(w.sock.recv_multipart()).op == "ack"


@pytest.mark.parametrize("honest_last", [False, True])
def test_a_save_of_another_step_is_refused_and_harms_no_one(serve, tmp_path, honest_last):
    """An insider's `save` of a step that is not the run's checkpoint step (step 0, which every clock matches
    before the first push) once set the step the server waited for, and every honest worker's save of the real
    checkpoint step was refused ("worker 0 asks for step 1, other workers for step 0"). Now it is refused
    alone. And an insider asking the real step before the honest worker does is answered with it, where the
    honest worker's own save once failed ("worker 1 already asked for step 1") or, asked once the part was
    written, waited for a save no one else would ask again until the server failed."""
    srv, creds = serve("plain", train={"checkpoint_every": 1})
    zctx = zmq.Context()
    try:
        insider, honest, other = (Worker(zctx, srv, creds, w) for w in (1, 1, 0))
        path = lambda step: str(tmp_dir(tmp_path / "checkpoints", step))   # noqa: E731
        r = insider.ask({"op": "save", "worker": 1, "step": 0, "path": path(0)}, wait_ms=10000)
        assert r is not None and r.op == "error" and "not a checkpoint step" in r.header["message"]
        assert not srv.snapshots.saves and srv.state.failure is None
        _push_once(honest, srv, 1)
        _push_once(other, srv, 0)
        tmp_dir(tmp_path / "checkpoints", 1).mkdir(parents=True)   # (the workers make it, in a run)
        order = [(insider, 1), (other, 0), (honest, 1)] if honest_last else [(insider, 1), (honest, 1), (other, 0)]
        for w, who in order:
            w.sock.send_multipart(wire.encode({"op": "save", "worker": who, "step": 1, "path": path(1)}))
            if honest_last and w is other:
                assert w.sock.poll(10000)   # the part is written before the honest worker asks
        for w, _ in order:
            assert w.sock.poll(10000), "no answer to a save"
            r = wire.decode(w.sock.recv_multipart())
            assert r.op == "ack", r.header
        assert (tmp_dir(tmp_path / "checkpoints", 1) / "server0.bin").is_file()
    finally:
        zctx.destroy(linger=0)
