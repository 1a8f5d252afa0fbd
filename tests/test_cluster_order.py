"""A flow's packets keep their order on the emulated links (psarch/cluster/emulated.py's shaper): only segments
without data go before the queues; a flow's short data segment waits behind its own flow's queued data."""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
import time

from cluster_setup import leftovers, needs_root
from psarch.cluster import netns
from psarch.cluster.emulated import EmulatedCluster
from timing import scaled


SIOCOUTQNSD = 0x894B   # linux/sockios.h: bytes a socket holds not yet sent


def _unsent(s: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(s.fileno(), SIOCOUTQNSD, b"\0" * 4))[0]


def _drain(ns: str, ready: threading.Event, port: list, got: list) -> None:
    with netns.inside(ns):
        srv = socket.create_server(("0.0.0.0", 0))
    port.append(srv.getsockname()[1])
    ready.set()
    conn = srv.accept()[0]
    got.append(sum(iter(lambda: len(conn.recv(1 << 16)), 0)))
    conn.close()
    srv.close()


@needs_root
def test_a_flows_short_segments_wait_behind_its_own_data():
    """A worker on a 100 Mbit/s link sends a server on a 10 Mbit/s link 64 KiB, then 10 bytes, twenty times on one
    connection (a PS message's large frame, then a small message): the server's link queues the worker's data, and
    each 10-byte segment waits behind it. Served first as a short packet (under 128 B), it overtook its own flow's
    queued data and the worker took the gap for a loss: 2026-11-29 on the shaper before, 667-814 reorderings seen
    by the worker (TCPSACKReorder) and 43-109 segments sent again (5 runs); on this one 0-1 and 0-3 (10 runs), a
    few with no queue dropping any (`tc -s qdisc`, `ip -s link`, /proc/net/softnet_stat) and no short data served
    first: the host's own, not the shaper's."""
    c = EmulatedCluster(1, 1, 100.0, 10.0)
    try:
        worker, server = c.node("worker", 0), c.node("server", 0)
        ready, port, got = threading.Event(), [], []
        t = threading.Thread(target=_drain, args=(server.ns, ready, port, got), daemon=True)
        t.start()
        assert ready.wait(scaled(10)), "the server did not listen"
        with netns.inside(worker.ns):
            s = socket.create_connection((server.address, port[0]), timeout=scaled(60))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        before = (netns.tcp_counters(worker.ns), netns.tcp_counters(server.ns))
        for _ in range(20):
            s.sendall(bytes(64 * 1024))
            deadline = time.monotonic() + scaled(60)
            while _unsent(s):      # all of it sent (queued on the way): the 10 bytes cannot join its last segment
                assert time.monotonic() < deadline, "the worker's 64 KiB did not leave its socket"
                time.sleep(0.001)
            s.sendall(b"0123456789")
        s.close()
        t.join(scaled(60))
        after = (netns.tcp_counters(worker.ns), netns.tcp_counters(server.ns))
    finally:
        c.close()
    assert got == [20 * (64 * 1024 + 10)], got
    moved = {k: after[i][k] - before[i][k] for i, k in ((1, "TcpExt.TCPOFOQueue"), (0, "Tcp.RetransSegs"),
                                                        (0, "TcpExt.TCPSACKReorder"))}
    # the server's segments queued out of order are shown, not bounded: 13-20 on the shaper before, 0-7 on this one
    assert moved["TcpExt.TCPSACKReorder"] < 20 and moved["Tcp.RetransSegs"] < 20, moved
    assert not leftovers(os.getpid())
