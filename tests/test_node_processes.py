"""A process psarch starts runs in the network namespace the launcher's thread stands in when it starts it (an
emulated cluster's node), also when psarch's forkserver, which lives in this machine's own namespace, forks it:
so an emulated run's ranks need not each import torch again (psarch.launch.processes)."""
from __future__ import annotations

import os
import subprocess

from cluster_setup import needs_root
from psarch.cluster import netns
from psarch.launch import processes

pytestmark = needs_root


def where_am_i(conn) -> None:
    """In the child: its network namespace (device, inode) and its parent's pid."""
    st = os.stat("/proc/self/ns/net")
    conn.send((st.st_dev, st.st_ino, os.getppid()))
    conn.close()


def _started(ctx, ns: str | None) -> tuple[int, int, int]:
    mine, theirs = ctx.Pipe()
    p = processes.process(ctx, where_am_i, (theirs,))
    if ns is None:
        p.start()
    else:
        with netns.inside(ns):
            p.start()
    theirs.close()
    try:
        assert mine.poll(60), "the child said nothing within 60 s"
        return mine.recv()
    finally:
        p.join(30)
        assert p.exitcode == 0, p.exitcode


def test_a_forkserver_child_runs_in_the_node_it_was_started_in():
    ns = f"psarch-{os.getpid()}-proc"   # a run's prefix: a later run removes it should this test die first
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        ctx = processes.context()
        node, host = os.stat(f"/run/netns/{ns}"), os.stat("/proc/self/ns/net")
        dev, ino, parent = _started(ctx, ns)
        assert (dev, ino) == (node.st_dev, node.st_ino), "the child is not in the node's namespace"
        assert parent != os.getpid(), "the child was not forked by the forkserver: nothing was entered"
        dev, ino, _ = _started(ctx, None)
        assert (dev, ino) == (host.st_dev, host.st_ino), "a child started outside any node left this namespace"
        assert not netns.pids(ns), "a child outlived its test inside the node"
    finally:
        netns.remove(ns)
    assert ns not in netns.names(f"psarch-{os.getpid()}-")
