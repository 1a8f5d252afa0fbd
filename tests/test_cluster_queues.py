"""The emulated links' queues under time dilation: a queue holds the bytes the cluster's would (QUEUE_S at the
cluster's rate), so N senders into one node lose nothing at D > 1 that they would not lose at D = 1."""
from __future__ import annotations

import os
import socket
import threading

from cluster_setup import leftovers, needs_root
from psarch.cluster import netns
from psarch.cluster.emulated import QUEUE_MAX, QUEUE_S, EmulatedCluster, shaper
from timing import scaled


def _bfifo_limits(commands: list[list[str]]) -> list[int]:
    return [int(c[c.index("limit") + 1]) for c in commands if "bfifo" in c]


def test_a_dilated_links_queues_hold_the_clusters_bytes():
    """A 100 Mbit/s link shaped at 100/32 Mbit/s (D = 32) queues as many bytes as the undilated link: QUEUE_S at
    100 Mbit/s in every FIFO, the node's own and each sender's on the bridge's end."""
    senders = ["10.213.1.1", "10.213.1.2"]
    dilated = _bfifo_limits(shaper("eth0", 100.0 / 32, senders, dilation=32.0))
    assert dilated == _bfifo_limits(shaper("eth0", 100.0, senders)) == [int(100e6 / 8 * QUEUE_S)] * 3, dilated


def test_a_fast_clusters_queues_stay_within_bfifos_limit():
    """bfifo's limit is a u32: a 400 Gbit/s cluster's QUEUE_S (10 GB) is held at QUEUE_MAX, which `tc` takes."""
    limits = _bfifo_limits(shaper("eth0", 400e3 / 40, ["10.213.1.1"], dilation=40.0))
    assert limits == [QUEUE_MAX] * 2 and QUEUE_MAX < 2**32, limits


def _drain(ns: str, ready: threading.Event, port: list, got: list) -> None:
    with netns.inside(ns):
        srv = socket.create_server(("0.0.0.0", 0), backlog=16)
    port.append(srv.getsockname()[1])
    ready.set()
    conns = [srv.accept()[0] for _ in range(4)]
    readers = [threading.Thread(target=lambda c=c: got.append(sum(iter(lambda: len(c.recv(1 << 16)), 0))))
               for c in conns]
    for t in readers:
        t.start()
    for t in readers:
        t.join(scaled(60))
    srv.close()


def _dropped(ns: str, dev: str) -> int:
    """Packets the qdiscs of `dev` in `ns` dropped (`tc -s qdisc`)."""
    shown = netns.run("tc", "-s", "-n", ns, "qdisc", "show", "dev", dev)
    return sum(int(line.split("dropped")[1].split()[0].rstrip(",")) for line in shown.splitlines() if "dropped" in line)


@needs_root
def test_incast_at_a_dilated_rate_drops_nothing():
    """Four workers push 400 kB each at once into one server on a 100 Mbit/s cluster run at D = 25 (links shaped to
    4 Mbit/s), as a PS's workers push a step's gradients: the server's link drops nothing, and each worker's link
    carries its bytes and their headers, no retransmissions (with queues of QUEUE_S at the shaped rate, 100 kB, the
    windows TCP opened overflowed them and a fifth more went on the wire)."""
    size, d = 400_000, 25.0
    c = EmulatedCluster(4, 1, 100.0 / d, 100.0 / d, dilation=d)
    try:
        server = c.node("server", 0)
        ready, port, got = threading.Event(), [], []
        t = threading.Thread(target=_drain, args=(server.ns, ready, port, got), daemon=True)
        t.start()
        assert ready.wait(scaled(10)), "the receiving node did not listen"
        socks = []
        for i in range(4):
            with netns.inside(c.node("worker", i).ns):
                socks.append(socket.create_connection((server.address, port[0]), timeout=scaled(60)))
        before = c.counters()
        pushes = [threading.Thread(target=s.sendall, args=(os.urandom(size),)) for s in socks]
        for p in pushes:
            p.start()
        for p in pushes:
            p.join(scaled(60))
        for s in socks:
            s.close()
        t.join(scaled(60))
        after = c.counters()
        assert sorted(got) == [size] * 4, got
        assert _dropped(c.hub, server.port) == 0
        for i in range(4):
            ns = c.node("worker", i).ns
            sent = after[ns][0] - before[ns][0]
            assert size < sent < size * 1.08, (i, sent)
    finally:
        c.close()
    assert not leftovers(os.getpid())
