"""A worker that waits for a reply its connection lost says so (psarch/ps/worker/client.py; issue 31).

ZeroMQ resends nothing a dropped connection carried and never retries a handshake a server refused: the worker
then waits backend.timeout_s for a reply no server has a request for. Its timeout's line names what its
connection to each silent server went through, so a lost reply is told from a slow one."""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import zmq

from psarch.ps.errors import PSError
from psarch.ps.worker.client import PSClient, Request
from timing import scaled


@contextlib.contextmanager
def a_request_taken() -> Iterator[tuple[zmq.Socket, PSClient]]:
    """A worker's client whose one request a bare ROUTER (the server) has taken and not answered."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = PSClient([f"tcp://127.0.0.1:{port}"], 0, timeout_s=1.0, heartbeat_s=0.0)
    try:
        client.post(0, Request({"op": "fetch"}))
        assert router.poll(5000) and router.recv_multipart()
        yield router, client
    finally:
        client.close()
        router.close(0)
        ctx.term()


def test_a_reply_lost_with_its_connection_is_named_in_the_timeout():
    with a_request_taken() as (router, client):
        router.close(0)   # the connection drops with the request on it, unanswered
        with pytest.raises(PSError, match=r"^worker 0: no reply from server 0 \(tcp://127\.0\.0\.1:\d+\) \[its connection: "
                                          r"dropped 1 x; what it carried then is lost\] within "):
            client.wait(timeout_s=scaled(1.0))


def test_a_slow_reply_is_not_called_lost():
    with a_request_taken() as (_, client):   # taken, never answered, its connection open
        with pytest.raises(PSError, match=r"^worker 0: no reply from server 0 \(tcp://127\.0\.0\.1:\d+\) within "):
            client.wait(timeout_s=scaled(0.5))
