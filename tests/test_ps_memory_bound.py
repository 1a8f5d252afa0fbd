"""What one connection can make a server hold, counted as ZeroMQ holds it (psarch/ps/server/connections.py): each
frame's exact ZMTP framing credited (never a flat allowance that builds up), a frame kept in FRAME_COST bytes
however short, and a message of more than wire.MAX_FRAMES frames dropped unparsed. Attacks by an insider (one
worker's PLAIN password) against a server thread and a spawned server process."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from psarch.config import from_dict
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from psarch.ps.layout import initial_flat
from psarch.ps.server.tcp_bytes import FRAME_COST, framing
from psarch.ps.server.parameter_server import ParameterServer
from psarch.ps.services import start_services
from ps_setup import config, ps
from zmtp_raw import RawPeer, frame
from timing import scaled

MiB = 2**20


def _cfg(**backend):
    return from_dict(config("bound", train={"optimizer": "sgd", "lr": 0.5}, workload={"model": "mlp"},
                            backend=ps(2, "async", auth="plain", **backend)))


@pytest.fixture
def server(tmp_path):
    keys = auth.keygen(tmp_path / "keys", 2, 1)
    cfg = _cfg(keys=str(keys), inflight_mb=1.0)
    flat = initial_flat(cfg)
    srv = ParameterServer(0, cfg, creds=Credentials("plain", str(keys)), numel=flat.numel())
    srv.initialize(flat)
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    yield srv
    srv.stop()
    thread.join(5)


def _password(folder: str, worker: int) -> str:
    return (Path(folder) / f"worker{worker}.password").read_text().strip()


def _bank_credit(peer: RawPeer, messages: int, frames: int) -> None:
    """Complete messages of empty frames (refused by the wire format, each answered with an error): under a flat
    64 bytes of framing a frame they once left the connection 62 bytes of credit a frame."""
    head = frame(msgpack.packb({"op": "fetch", "worker": 0}), more=True)
    body = frame(b"", more=True) * (frames - 1) + frame(b"")
    for _ in range(messages):
        peer.send(head + body)
    _read_replies(peer)


def _read_replies(peer: RawPeer, quiet_s: float = 1.0) -> None:
    """Read what the server answered until it is quiet for `quiet_s`: a server whose replies a peer leaves
    unread stops reading from it (ZeroMQ), and the attack would never reach the server."""
    peer.sock.settimeout(quiet_s)
    try:
        while peer.sock.recv(1 << 16):
            pass
    except (socket.timeout, ConnectionError):
        pass


def _unfinished(peer: RawPeer, nbytes: int, rate: float | None = None) -> int:
    """An unfinished message of empty frames (2 bytes each on the wire, FRAME_COST held), at most `rate` bytes a
    second if given: the bytes sent."""
    sent, chunk = 0, frame(b"", more=True) * (16 * 1024)
    start = time.monotonic()
    try:
        peer.send(frame(msgpack.packb({"op": "fetch", "worker": 0}), more=True))
        while sent < nbytes:
            peer.send(chunk)
            sent += len(chunk)
            if rate:
                time.sleep(max(0.0, start + sent / rate - time.monotonic()))
    except OSError:
        pass
    return sent


def test_framing_is_what_the_wire_carries():
    assert [framing(n, False) for n in (0, 255, 256, 4 * MiB)] == [2, 2, 9, 9]
    assert [framing(n, True) for n in (0, 222, 223)] == [35, 35, 42]
    assert FRAME_COST // framing(0, False) == 32


def test_credit_from_many_frames_no_longer_lets_an_unfinished_message_past_the_budget(server):
    """100 complete messages of 1000 empty frames once left 6 MB of credit, so an unfinished 4 MiB message of
    empty frames (128 MiB held) stayed under a 1 MiB budget. Now the connection is dropped."""
    peer = RawPeer(server.port, "0", _password(server.creds.folder, 0)).connect()
    try:
        _bank_credit(peer, 100, 1000)
        assert server.meter.report().to_dict()["ops"]["invalid"]["calls"] == 100
        _unfinished(peer, 4 * MiB)
        assert peer.closed_by_server(10.0)
        assert server.connections.dropped["inflight"] == 1, server.connections.dropped
    finally:
        peer.close()


def test_a_message_of_too_many_frames_is_dropped_unparsed_and_others_are_served(server):
    """One complete message of 600k empty frames (1.2 MB, within the budget there) once blocked the server's
    loop for 24 s while pyzmq made a frame object of each and the wire format refused it. Now (400k frames
    within this budget) the connection is dropped at frame MAX_FRAMES + 1 and the rest read and thrown away;
    the next worker is served."""
    zctx = zmq.Context()
    try:
        attacker, worker = (zctx.socket(zmq.DEALER) for _ in range(2))
        for w, s in enumerate((attacker, worker)):
            s.setsockopt(zmq.LINGER, 0)
            auth.client_socket(s, server.creds, w, 0)
            s.connect(server.address)
        attacker.send_multipart([msgpack.packb({"op": "fetch", "worker": 0})] + [b""] * 400_000)
        deadline = time.monotonic() + scaled(30)
        while not attacker.poll(0) and not server.connections.dropped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.connections.dropped == {"frames": 1}
        worker.send_multipart(wire.encode({"op": "fetch", "worker": 1}))
        assert worker.poll(30000)
        assert wire.decode(worker.recv_multipart()).op == "params"
        assert not attacker.poll(100)   # no reply: the message was never parsed
    finally:
        zctx.destroy(linger=0)


def _rss(pid: int) -> float:
    return int(next(x for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS")).split()[1]) * 1024


def test_a_server_process_holds_at_most_the_stated_bound_under_an_attack_at_twice_it():
    """The README's bound for one connection under PLAIN: FRAME_COST / 2 x (budget in + what the link delivers
    while the watchdog looks again) + budget out; at inflight_mb = 1 and an attacker sending 2 MB/s, with the
    watchdog up to 0.1 s late on a loaded machine, 39.1 MiB. An insider banks credit with complete messages, then
    sends an unfinished message of empty frames that would hold twice that: the server process's resident
    memory, sampled all along, grows by at most the bound."""
    services = start_services(_cfg(inflight_mb=1.0), None)
    try:
        pid, port = services.workers[0].pid, int(services.info.addresses[0].rsplit(":", 1)[1])
        password = _password(Credentials.from_dict(services.info.auth).folder, 0)
        budget, rate = MiB, 2e6
        bound = FRAME_COST // framing(0, False) * (budget + rate * 0.1) + budget
        peer = RawPeer(port, "0", password).connect()
        _bank_credit(peer, 100, 1000)
        time.sleep(1.0)
        base, peak, stop = _rss(pid), [0.0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss(pid) - base)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            _unfinished(peer, int(2 * bound * framing(0, False) // FRAME_COST), rate)
            assert peer.closed_by_server(10.0)
            time.sleep(0.2)
        finally:
            stop.set()
            sampler.join()
            peer.close()
        assert peak[0] <= bound, f"+{peak[0] / MiB:.1f} MiB held against a bound of {bound / MiB:.0f} MiB"
        services.check()
    finally:
        services.stop()


def test_short_frames_one_per_segment_hold_their_own_bytes_not_a_read_buffer():
    """An unfinished message of 34-byte frames, each sent in a TCP segment of its own: libzmq kept each as a
    reference into the 8 KiB buffer it was read into, so each pinned a buffer (+270 MiB for 1.2 MB on the
    wire, 6x the bound). The server's context now copies frames out (ZMQ_ZERO_COPY_RECV = 0): the server's
    memory stays within the bound while its budget fills."""
    services = start_services(_cfg(inflight_mb=0.25), None)
    try:
        pid, port = services.workers[0].pid, int(services.info.addresses[0].rsplit(":", 1)[1])
        password = _password(Credentials.from_dict(services.info.auth).folder, 0)
        budget = MiB // 4
        bound = FRAME_COST // framing(0, False) * budget + budget
        peer = RawPeer(port, "0", password).connect()
        peer.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        base, peak = _rss(pid), 0.0
        short = frame(b"x" * 34, more=True)
        try:
            peer.send(frame(msgpack.packb({"op": "fetch", "worker": 0}), more=True))
            for n in range(2 * budget // len(short)):
                peer.send(short)
                time.sleep(0.0002)
                if n % 500 == 0:
                    peak = max(peak, _rss(pid) - base)
        except OSError:
            pass   # dropped at the budget
        peak = max(peak, _rss(pid) - base)
        assert peer.closed_by_server(10.0)
        assert peak <= bound, f"+{peak / MiB:.1f} MiB held against a bound of {bound / MiB:.0f} MiB"
        services.check()
    finally:
        peer.close()
        services.stop()
