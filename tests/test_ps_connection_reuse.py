"""A connection that reuses a closed one's descriptor before the watchdog has read the close is still answered
(psarch/ps/server/connections.py). ZeroMQ's monitor names connections by descriptor, and the watchdog reads it
every PERIOD_S: a worker whose new connection got the descriptor of one that had just closed was marked gone when
the late DISCONNECTED was read, so the server never sent it a reply and a sync round waited for good."""
from __future__ import annotations

import time

import zmq

from psarch.ps.server.connections import Caps, Connections


def _first_message(ctx: zmq.Context, router: zmq.Socket, addr: str, tag: bytes, peers: list):
    peer = ctx.socket(zmq.DEALER)
    peers.append(peer)
    peer.linger = 0
    peer.connect(addr)
    peer.send(tag)
    frames = router.recv_multipart(copy=False)
    assert frames[1].bytes == tag
    return peer, frames


def test_a_new_connection_on_a_closed_ones_descriptor_is_answered_though_the_watchdog_lags():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind("tcp://127.0.0.1:0")
    addr = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    conns = Connections(router, lambda: 2**20, 0.0, Caps(total=64, per_worker=64, pending=64, prove_s=5.0))
    conns._stop.set()        # the watchdog stopped: the monitor's events are read only where the code reads them
    conns._thread.join()
    peers: list[zmq.Socket] = []
    try:
        old, frames = _first_message(ctx, router, addr, b"old", peers)
        assert conns.received(frames)
        conns._events()
        fd = frames[0].get(zmq.SRCFD)
        assert conns.may_send(frames[0].bytes, 10)
        old.close()
        time.sleep(0.2)      # ZeroMQ has closed it: DISCONNECTED waits in the monitor, unread
        _, frames = _first_message(ctx, router, addr, b"new", peers)
        assert frames[0].get(zmq.SRCFD) == fd, "the kernel gave the new connection another descriptor"
        assert conns.received(frames)
        conns._events()      # the watchdog's next pass
        assert conns.may_send(frames[0].bytes, 10), "the new connection's reply would not be sent"
    finally:
        for peer in peers:
            peer.close()
        conns.close()
        router.close()
        ctx.term()


def test_a_workers_dropped_connection_is_said_once_per_why(capsys):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind("tcp://127.0.0.1:0")
    addr = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    conns = Connections(router, lambda: 2**20, 0.0, Caps(total=64, per_worker=64, pending=64, prove_s=5.0),
                        name="server 3")
    peers: list[zmq.Socket] = []
    try:
        for tag in (b"a", b"b"):
            _, frames = _first_message(ctx, router, addr, tag, peers)
            assert conns.received(frames)
            conns.drop_sender(frames[0], "frames")
        assert conns.dropped["frames"] == 2
        err = capsys.readouterr().err.splitlines()
        assert err == ["server 3: shut down a worker's connection (a message of too many frames); a request it had "
                       "sent is not answered, and its worker waits for it up to backend.timeout_s"]
    finally:
        for peer in peers:
            peer.close()
        conns.close()
        router.close()
        ctx.term()


def test_a_connection_past_the_cap_is_dropped_and_said(capsys):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind("tcp://127.0.0.1:0")
    addr = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    conns = Connections(router, lambda: 2**20, 0.0, Caps(total=1, per_worker=1, pending=64, prove_s=5.0),
                        name="server 0")
    peers: list[zmq.Socket] = []
    try:
        _, first = _first_message(ctx, router, addr, b"a", peers)
        assert conns.received(first)
        _, second = _first_message(ctx, router, addr, b"b", peers)
        assert not conns.received(second)   # over backend.max_connections = 1: ignored, its connection shut
        assert conns.dropped["over_cap"] == 1
        assert capsys.readouterr().err.startswith("server 0: shut down a worker's connection (past a connection cap)")
    finally:
        for peer in peers:
            peer.close()
        conns.close()
        router.close()
        ctx.term()
