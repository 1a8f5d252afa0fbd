"""Servers speak only to workers that authenticate, each only as itself: strangers cannot push, pull,
fetch, stop a server or start a silence clock; a worker's key cannot act as another worker; peers that
stall (mid-handshake or mid-message) are dropped; a crowd of unauthenticated peers never reaches the
ROUTER. Servers are threads of the test process on loopback."""
from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch
import zmq

from psarch.config import from_dict
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from psarch.ps.layout import initial_flat
from psarch.ps.server.parameter_server import ParameterServer
from ps_setup import config, ps
from timing import scaled


@pytest.fixture
def serve(tmp_path):
    """serve(mechanism, **backend) -> (server, creds): a ParameterServer thread with keys in tmp_path."""
    started, keys = [], auth.keygen(tmp_path / "keys", 2, 1)

    def make(mechanism: str, **extra) -> tuple[ParameterServer, Credentials]:
        cfg = from_dict(config("auth", train={"optimizer": "sgd", "lr": 0.5}, workload={"model": "mlp"},
                               backend=ps(2, "async", auth=mechanism, keys=str(keys), **extra)))
        creds = Credentials(mechanism, str(keys) if mechanism != "none" else "")
        flat = initial_flat(cfg)
        srv = ParameterServer(0, cfg, exit_when_done=True, creds=creds, numel=flat.numel())
        srv.initialize(flat)
        thread = threading.Thread(target=srv.serve, daemon=True)
        thread.start()
        started.append((srv, thread))
        return srv, creds

    yield make
    for srv, thread in started:
        srv.stop()
        thread.join(5)


class Peer:
    """A DEALER that speaks the wire; `creds`/`worker`: whom it authenticates as (None: no one)."""

    def __init__(self, zctx: zmq.Context, address: str, creds: Credentials | None, worker: int = 0,
                 routing_id: bytes | None = None) -> None:
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if creds is not None:
            auth.client_socket(self.sock, creds, worker, 0)
        self.sock.connect(address)

    def ask(self, header: dict, tensor: torch.Tensor | None = None, wait_ms: int = 2000) -> wire.Message | None:
        self.sock.setsockopt(zmq.SNDTIMEO, wait_ms)   # a DEALER with no peer past its handshake cannot send
        try:
            self.sock.send_multipart(wire.encode(header, tensor))
        except zmq.Again:
            return None
        return wire.decode(self.sock.recv_multipart()) if self.sock.poll(wait_ms) else None


PARTS = 0.001   # MiB: the server's range in partitions of 256 elements, each request naming one


def _requests(srv: ParameterServer, worker: int) -> list[tuple[dict, torch.Tensor | None]]:
    """Every request a worker sends, naming `worker`: pushes (poison, were it applied) and pulls of partitions."""
    first, second = srv.state.parts[:2]
    g = torch.full((first.hi - first.lo,), float("nan"))
    h = torch.full((second.hi - second.lo,), float("nan"))
    return [({"op": "push", "worker": worker, "step": 0, "version": 0, "offset": first.lo}, g),
            ({"op": "push", "worker": worker, "step": 0, "version": 0, "offset": second.lo}, h),
            ({"op": "pushpull", "worker": worker, "step": 0, "version": 0, "offset": first.lo}, g.zero_()),
            ({"op": "pull", "worker": worker, "step": 0, "want": "float32"}, None),
            ({"op": "pull", "worker": worker, "step": 0, "want": "float32", "offset": second.lo}, None),
            ({"op": "fetch", "worker": worker}, None),
            ({"op": "save", "worker": worker, "step": 0, "path": "/tmp/elsewhere"}, None),
            ({"op": "done", "worker": worker}, None), ({"op": "done", "worker": 1 - worker}, None)]


@pytest.mark.parametrize("mechanism", ["plain", "curve"])
def test_strangers_get_nothing_and_change_nothing(serve, mechanism, tmp_path):
    """No credentials, a wrong password or an unlisted CURVE key: no reply to any request, the state and
    the silence clocks untouched, `done` x2 does not stop the server; a real worker is then served."""
    srv, creds = serve(mechanism, partition_mb=PARTS)
    before = srv.state.params().clone()
    zctx = zmq.Context()
    try:
        strangers = [Peer(zctx, srv.address, None)]
        if mechanism == "plain":
            (tmp_path / "wrong").mkdir()
            (tmp_path / "wrong" / "worker0.password").write_text("guess")
            strangers.append(Peer(zctx, srv.address, Credentials("plain", str(tmp_path / "wrong")), 0))
        else:   # a well-formed key pair the server does not list, knowing the server's public key
            other = auth.keygen(tmp_path / "other", 1, 1)
            (other / "server0.key").write_bytes((tmp_path / "keys" / "server0.key").read_bytes())
            strangers.append(Peer(zctx, srv.address, Credentials("curve", str(other)), 0))
        for peer in strangers:
            for header, tensor in _requests(srv, 0):
                assert peer.ask(header, tensor, wait_ms=150) is None, header
        assert torch.equal(srv.state.params(), before)
        s = srv.state
        assert s.version == 0 and not s.done and s.last_seen is None and not s.stopping
        # (a peer without credentials fails on the mechanism itself, before ZAP is asked)
        assert srv.state.rejected == 0 and srv.zap.refused >= len(strangers) - 1
        worker = Peer(zctx, srv.address, creds, 1)
        r = worker.ask({"op": "fetch", "worker": 1})
        assert r is not None and r.op == "params" and torch.equal(r.tensor(), before)
    finally:
        zctx.destroy(linger=0)


@pytest.mark.parametrize("mechanism", ["plain", "curve"])
def test_a_worker_acts_only_as_itself(serve, mechanism):
    """Worker 0's credentials naming worker 1: every request refused with a reply that carries no state
    (no version, no step), nothing applied, worker 1's silence clock not started, done not counted."""
    srv, creds = serve(mechanism, partition_mb=PARTS)
    before = srv.state.params().clone()
    zctx = zmq.Context()
    try:
        w0 = Peer(zctx, srv.address, creds, 0)
        requests = _requests(srv, 1)[:-1]
        for header, tensor in requests:
            r = w0.ask(header, tensor)
            assert r is not None and r.op == "error", header
            assert set(r.header) == {"op", "message"}
            assert "authenticated as worker 0" in r.header["message"]
            assert "version" not in r.header["message"] and "step" not in r.header["message"]
        assert torch.equal(srv.state.params(), before)
        assert srv.state.impostors == len(requests) and not srv.state.done and srv.state.last_seen is None
        assert w0.ask({"op": "done", "worker": 0}).op == "ack" and srv.state.done == {0}
    finally:
        zctx.destroy(linger=0)


def test_crowd_choosing_routing_ids_never_reaches_the_router(serve, tmp_path):
    """~65 unauthenticated peers with routing ids of libzmq's own form (0x00 + a 32-bit counter) once
    aborted the server; now their handshakes fail before any routing id is registered."""
    srv, creds = serve("plain", max_connections=200)
    zctx = zmq.Context()
    try:
        wrong = tmp_path / "wrong"
        wrong.mkdir()
        (wrong / "worker0.password").write_text("guess")
        crowd = [Peer(zctx, srv.address, Credentials("plain", str(wrong)), 0,
                      routing_id=b"\x00" + struct.pack(">I", i)) for i in range(66)]
        for p in crowd:
            p.ask({"op": "fetch", "worker": 0}, wait_ms=0)
        deadline = time.monotonic() + scaled(20)
        while srv.zap.refused < len(crowd) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.zap.refused >= len(crowd)
        r = Peer(zctx, srv.address, creds, 0).ask({"op": "fetch", "worker": 0})
        assert r is not None and r.op == "params" and srv.state.rejected == 0
    finally:
        zctx.destroy(linger=0)


def test_connections_beyond_the_cap_are_refused(serve):
    """max_connections connections past their handshake (authenticated workers): the next worker is refused
    until one goes. (Handshakes in progress hold no slot: tests/test_ps_pressure.py.)"""
    srv, creds = serve("plain", max_connections=3)
    zctx = zmq.Context()
    try:
        holders = [Peer(zctx, srv.address, creds, w) for w in (0, 1, 0)]
        for h, w in zip(holders, (0, 1, 0)):
            assert h.ask({"op": "fetch", "worker": w}).op == "params"
        refused = Peer(zctx, srv.address, creds, 1)
        assert refused.ask({"op": "fetch", "worker": 1}, wait_ms=500) is None
        assert srv.zap.refused >= 1
        holders[0].sock.close(linger=0)
        deadline = time.monotonic() + scaled(5)
        while srv.connections.authenticated >= 3 and time.monotonic() < deadline:   # the server saw it close
            time.sleep(0.05)
        r = Peer(zctx, srv.address, creds, 1).ask({"op": "fetch", "worker": 1}, wait_ms=5000)
        assert r is not None and r.op == "params"
    finally:
        zctx.destroy(linger=0)


def _null_greeting() -> bytes:
    """ZMTP 3.0 greeting of a NULL-mechanism client, then its READY command (Socket-Type DEALER)."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    return greeting + b"\x04" + bytes([len(body)]) + body


@pytest.mark.parametrize("stage", ["handshake", "message"])
def test_a_slowloris_peer_is_dropped_within_the_heartbeat_timeout(serve, stage):
    """A raw TCP peer that stops mid-handshake (plain server: backend.handshake_timeout_s) or, past a NULL
    handshake, in the middle of a frame and answers no heartbeat (auth none): the server closes its connection
    within the timeout."""
    timeout = 1.0
    srv, _ = serve("plain" if stage == "handshake" else "none", heartbeat_s=0.2, heartbeat_timeout_s=timeout,
                   handshake_timeout_s=timeout)
    limit = min(scaled(4 * timeout + 1.0), 20.0)   # stretched by the load, below the 30 s default it must not use
    peer = socket.create_connection(("127.0.0.1", srv.port))
    peer.settimeout(limit + 1.0)
    t0 = time.monotonic()
    if stage == "handshake":
        peer.sendall(b"\xff" + bytes(8))          # a third of a greeting, then nothing
    else:
        peer.sendall(_null_greeting() + b"\x02" + struct.pack(">Q", 1000) + b"partial")   # 7 of 1000 bytes
    try:
        while peer.recv(4096):                   # the server's greeting, READY, PINGs ... until it hangs up
            pass
    except ConnectionResetError:
        pass
    assert time.monotonic() - t0 < limit
    peer.close()


@pytest.mark.parametrize("signal_name", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_dead_server_is_named(signal_name):
    """The launcher's check names a server that died, or that has been stopped for backend.timeout_s
    (before, the run ended with "no rank left a record" once every worker had timed out on it)."""
    import os
    import signal

    from psarch.ps.errors import ServiceError
    from psarch.ps.services import start_services

    cfg = from_dict(config("stop", workload={"model": "mlp"}, backend=ps(1, "async", timeout_s=1.0)))
    services = start_services(cfg, None)
    pid = services.workers[0].pid
    try:
        services.check()
        os.kill(pid, getattr(signal, signal_name))
        deadline = time.monotonic() + scaled(15)
        with pytest.raises(ServiceError, match=r"server 0 (died|\(pid \d+\) has been stopped \(SIGSTOP\?\) for "
                                               r"more than backend.timeout_s = 1 s)"):
            while time.monotonic() < deadline:
                services.check()
                time.sleep(0.2)
    finally:
        if signal_name == "SIGSTOP":
            os.kill(pid, signal.SIGCONT)
        services.stop()


def test_auth_none_only_on_loopback_and_standalone_servers_need_keys(tmp_path, capsys):
    """backend.auth = "none" beyond loopback, and a `psarch server` without keys, stop with one line
    saying what to do; nothing is started."""
    from psarch.ps.services import start_services
    from psarch.ps.standalone import serve as standalone

    cfg = from_dict(config("none", workload={"model": "mlp"}, backend=ps(1, "async", auth="none", host="0.0.0.0")))
    with pytest.raises(auth.AuthError, match=r"backend.auth = \"none\": allowed only on loopback, but servers "
                                             r"bind '0.0.0.0'"):
        start_services(cfg, None)
    toml = tmp_path / "s.toml"
    toml.write_text('[workload]\nmodel = "mlp"\n[backend]\nkind = "ps"\n')
    assert standalone(str(toml), 0, 0, "0.0.0.0") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "psarch keygen DIR" in err and "0.0.0.0" in err and "curve" in err


def test_keygen_writes_private_credentials_and_bad_bounds_stop_at_config(tmp_path, capsys):
    """`psarch keygen` writes a key pair per worker and server and a password per worker, secrets 0600;
    a heartbeat timeout no longer than the interval is a config error naming both keys."""
    import os

    from psarch.cli import main
    from psarch.config import ConfigError

    assert main(["keygen", str(tmp_path / "k"), "--workers", "2", "--servers", "2"]) == 0
    assert "backend.keys" in capsys.readouterr().out
    names = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert names == sorted([f"{r}{i}.{x}" for r in ("worker", "server") for i in (0, 1) for x in ("key", "key_secret")]
                           + ["worker0.password", "worker1.password"])
    for name in names:
        if not name.endswith(".key"):
            assert os.stat(tmp_path / "k" / name).st_mode & 0o077 == 0, name
    auth.check_folder(tmp_path / "k", "curve", 2, 2)
    with pytest.raises(auth.AuthError, match="no worker2.key there; run `psarch keygen"):
        auth.check_folder(tmp_path / "k", "curve", 3, 2)
    assert main(["keygen", str(tmp_path / "z"), "--workers", "0"]) == 2
    with pytest.raises(ConfigError, match=r"backend.heartbeat_timeout_s = 2: must be longer than backend.heartbeat_s = 5"):
        from_dict(config("hb", backend=ps(1, "async", heartbeat_s=5.0, heartbeat_timeout_s=2.0)))


def test_a_non_ascii_plain_password_is_refused_and_the_server_stays_up(serve):
    """A stranger's PLAIN handshake as worker "0" with a non-ASCII password once raised in the ZAP
    handler (compare_digest on str) and ended the serve loop; now it is refused and a worker is served."""
    srv, creds = serve("plain")
    zctx = zmq.Context()
    try:
        stranger = zctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.PLAIN_USERNAME, b"0")
        stranger.setsockopt(zmq.PLAIN_PASSWORD, "pässwörd".encode())
        stranger.connect(srv.address)
        deadline = time.monotonic() + scaled(5)
        while srv.zap.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.zap.refused == 1 and not srv.state.stopping
        r = Peer(zctx, srv.address, creds, 0).ask({"op": "fetch", "worker": 0})
        assert r is not None and r.op == "params"
    finally:
        zctx.destroy(linger=0)


def test_a_dilated_heartbeat_timeout_past_what_a_ping_carries_binds():
    """A heartbeat timeout that dilation stretched past what a PING carries whole (655 deciseconds: the peer's
    libzmq multiplies it by 100 in 16 bits; 30 s x D = 230) still makes a socket: the peer is told no deadline (0,
    not a wrapped or shorter one), the local timeout holds the whole; one a PING carries is told as it is."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    try:
        auth.bound(sock, 10.0 * 230, 30.0 * 230)
        assert sock.getsockopt(zmq.HEARTBEAT_TTL) == 0
        assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 30 * 230 * 1000
        auth.bound(sock, 10.0, auth.MAX_HEARTBEAT_TTL_MS / 1000)
        assert sock.getsockopt(zmq.HEARTBEAT_TTL) == auth.MAX_HEARTBEAT_TTL_MS
    finally:
        sock.close(linger=0)
