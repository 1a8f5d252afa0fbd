"""A worker whose request was lost with its connection sends it again once the connection is back, and one that
waits for a server that is gone says so (psarch/ps/worker/resend.py; issue 31).

ZeroMQ resends nothing a dropped connection carried and never retries a handshake a server refused: the worker
sends every unanswered request again, under its id, when its connection comes back (or after
backend.resend_timeout_s). Where no server comes back, its timeout's line names what its connection to each silent
server went through, so a lost reply is told from a slow one."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import msgpack
import pytest
import torch
import zmq

from psarch.ps import wire
from psarch.ps.errors import PSError
from psarch.ps.worker.client import PSClient, Request
from timing import scaled


@contextlib.contextmanager
def a_request_taken(resend_s: float = 0.0) -> Iterator[tuple[zmq.Context, zmq.Socket, PSClient, int, list]]:
    """A worker's client whose one request (a fetch) a bare ROUTER (the server) has taken and not answered: the
    context, the ROUTER, the client, the port and the request's frames as taken (routing id first)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = PSClient([f"tcp://127.0.0.1:{port}"], 0, timeout_s=1.0, heartbeat_s=0.0, resend_s=resend_s)
    routers = [router]
    try:
        client.post(0, Request({"op": "fetch"}))
        assert router.poll(5000)
        yield ctx, router, client, port, router.recv_multipart()
    finally:
        client.close()
        for r in routers:
            r.close(0)
        ctx.term()


def _when_free(port: int) -> None:
    """Return once `port` can be bound again. ZeroMQ closes a socket in its reaper thread, after close() returns: a
    bind of the closed socket's port before then fails (address in use), and a context holding a socket whose bind
    failed never terminated (libzmq issue 4097): `ctx.term()` hung in about one run in ten."""
    deadline = time.monotonic() + scaled(10)
    while True:
        probe = socket.socket()
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as ZeroMQ's listener does
        try:
            probe.bind(("127.0.0.1", port))
            return
        except OSError:
            assert time.monotonic() < deadline, f"port {port} was not released"
            time.sleep(0.01)
        finally:
            probe.close()


def _rid(frames: list) -> int:
    return msgpack.unpackb(frames[1])["rid"]


def _answer(router: zmq.Socket, frames: list, version: int = 3) -> None:
    """The reply a server sends a fetch, naming the request's id."""
    router.send_multipart([frames[0], *wire.encode({"op": "params", "version": version, "offset": 0,
                                                    "rid": _rid(frames)}, torch.zeros(2))])


def test_a_request_lost_with_its_connection_is_sent_again_once_the_server_is_back():
    with a_request_taken() as (ctx, router, client, port, taken):
        router.close(0)   # the connection drops with the request on it, unanswered
        back = ctx.socket(zmq.ROUTER)
        back.linger = 0
        waited: list[BaseException | None] = []
        worker = threading.Thread(target=lambda: waited.append(_waited(client)))   # the worker waits; the test serves
        try:
            _when_free(port)
            back.bind(f"tcp://127.0.0.1:{port}")
            worker.start()
            assert back.poll(int(scaled(5) * 1000)), "the request was not sent again"
            again = back.recv_multipart()
            assert again[1:] == taken[1:] and _rid(again) == _rid(taken)   # the same request, id and all
            _answer(back, again)
            worker.join(scaled(10))
            assert waited == [None]
            assert client.connections[0].back == 1 and client.connections[0].resent == 1
        finally:
            worker.join(scaled(10))
            back.close(0)


def _waited(client: PSClient) -> BaseException | None:
    try:
        client.wait(timeout_s=scaled(5))
    except PSError as e:
        return e
    return None


def test_a_server_that_is_gone_is_named_in_the_timeout():
    with a_request_taken() as (_, router, client, _port, _taken):
        router.close(0)   # the connection drops with the request on it, and nothing comes back
        with pytest.raises(PSError, match=r"^worker 0: no reply from server 0 \(tcp://127\.0\.0\.1:\d+\) \[its connection: "
                                          r"dropped 1 x; not back since: what it carried could not be sent "
                                          r"again\] within "):
            client.wait(timeout_s=scaled(1.0))


def test_a_slow_reply_is_not_called_lost():
    with a_request_taken() as (*_, client, _port, _taken):   # taken, never answered, its connection open
        with pytest.raises(PSError, match=r"^worker 0: no reply from server 0 \(tcp://127\.0\.0\.1:\d+\) within "):
            client.wait(timeout_s=scaled(0.5))


def test_a_request_unanswered_past_the_resend_timeout_is_sent_again_under_its_id_and_answered_once():
    """Both copies answered: the request takes the first reply, and the second, taken before the next request's
    own, is dropped (a server that got both copies answers both: psarch/ps/server/repeats.py)."""
    with a_request_taken(resend_s=0.2) as (_, router, client, _port, taken):
        with pytest.raises(PSError, match=r"\[its connection: \d+ request\(s\) sent again\] within "):
            client.wait(timeout_s=0.7)
        assert router.poll(int(scaled(5) * 1000))
        again = router.recv_multipart()
        assert again[1:] == taken[1:] and _rid(again) == _rid(taken)
        while router.poll(100):   # (more copies, one per resend_s)
            router.recv_multipart()
        _answer(router, taken)
        _answer(router, again)
        client.wait(timeout_s=scaled(5))
        nxt = Request({"op": "fetch"})
        client.post(0, nxt)
        stale = 0
        while True:   # a copy sent when the second wait began, before its reply was taken, may come first
            assert router.poll(int(scaled(5) * 1000))
            frames = router.recv_multipart()
            if _rid(frames) == nxt.rid:
                break
            assert _rid(frames) == _rid(taken)
            _answer(router, frames)   # answered too, as a server answers each copy: dropped by the client
            stale += 1
        _answer(router, frames, version=5)
        client.wait(until=nxt, timeout_s=scaled(5))
        assert nxt.reply["version"] == 5
        one = wire.frames_bytes(wire.encode({"op": "params", "version": 3, "offset": 0, "rid": _rid(taken)},
                                            torch.zeros(2)))
        assert client.meter.report().ops["resend"].received == (1 + stale) * one   # each repeat's reply dropped
