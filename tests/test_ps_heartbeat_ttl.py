"""A heartbeat timeout that dilation stretched past what a PING's TTL carries never drops a quiet connection
(psarch/ps/auth.py's `bound`; issue 31).

A socket tells its peer its heartbeat timeout in every PING (ZMQ_HEARTBEAT_TTL, deciseconds in 16 bits), and the
peer's libzmq arms a timer of that many deciseconds x 100 ms, computed in 16 bits: past 655 deciseconds it wraps
(65.6 s: 64 ms; 330 s, 30 s x D = 11: 2.32 s). The peer then dropped a connection that was merely quiet between two
PINGs, with the requests in flight on it, and the worker's reconnections reached ZAP's per-worker cap, which refused
it for good: at N = 8 under dilation, workers waited backend.timeout_s for replies no server had a request for."""
from __future__ import annotations

import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from psarch.ps import auth

HEARTBEAT_S = 0.3   # the peer's PINGs: 300 ms apart, far more than a wrapped timer of 64 or 28 ms
QUIET_S = 2.0       # a wrapped timer fires within HEARTBEAT_S of the first PING: this is well past it


@pytest.mark.parametrize("timeout_s", [65.6, 131.1])   # TTLs that wrap to 64 ms and 28 ms
def test_a_quiet_connection_outlives_pings_whose_timeout_dilation_stretched(timeout_s):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    monitor = None
    try:
        router.linger = dealer.linger = 0
        auth.bound(router, 0.0, timeout_s)   # no PINGs of its own: it keeps only the deadline the peer's carry
        port = router.bind_to_random_port("tcp://127.0.0.1")
        monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        auth.bound(dealer, HEARTBEAT_S, timeout_s)
        assert dealer.getsockopt(zmq.HEARTBEAT_TIMEOUT) == int(timeout_s * 1000)   # its own deadline, whole
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"first")
        assert router.poll(5000) and router.recv_multipart()[1] == b"first"
        events = []
        end = time.monotonic() + QUIET_S
        while time.monotonic() < end:
            if monitor.poll(50):
                events.append(zmq.Event(recv_monitor_message(monitor)["event"]).name)
        assert events == ["ACCEPTED"], f"the connection, quiet {QUIET_S} s between PINGs: {events}"
        dealer.send(b"second")   # on the same connection: nothing sent on it was lost
        assert router.poll(5000) and router.recv_multipart()[1] == b"second"
    finally:
        if monitor is not None:
            router.disable_monitor()
            monitor.close(0)
        dealer.close(0)
        router.close(0)
        ctx.term()
