"""Where the processes of a run live: on this machine's loopback, or on an emulated cluster.

The launcher's one interface to this package is `place(cfg)`, a context manager giving a placement:

    with place(cfg) as p:
        with p.rendezvous(): store = TCPStore(...)            # ranks reach it at p.rendezvous_host
        marks = p.step_marks(ranks)                           # rank r: marks[r].reached() around its steps
        with p.node("worker", rank): process.start()          # the process (from p.context()) starts on its node
        host = p.host("server", i, cfg.backend.host)          # the address service i (a PS server) binds
        p.worker_lost()                                       # a worker died and the run goes on
        summary["cluster"] = p.report()

Backends never see it: on a node, a rank's sockets simply belong to that node's network.
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Iterator

from psarch import registry
from psarch.cluster import device
from psarch.cluster.window import StepMarks, StepWindow
from psarch.config import Config
from psarch.launch import processes

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext

    from psarch.cluster.emulated import Node
    from psarch.cluster.records import ClusterReport, NodeReport

# at a step mark, {node namespace: (bytes sent, bytes received)} and {node: (packets sent, received, retransmitted)}
Marks = tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int, int]]]


class Loopback:
    """Every process on this machine's loopback: today's behaviour, and the default."""

    rendezvous_host = "127.0.0.1"

    def context(self) -> BaseContext:
        """Where the run's processes come from: the forkserver (psarch.launch.processes)."""
        return processes.context()

    def rendezvous(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def node(self, role: str, index: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def host(self, role: str, index: int, default: str) -> str:
        return default

    def step_marks(self, ranks: int) -> list[StepMarks] | None:
        return None

    def worker_lost(self) -> None:
        pass

    def report(self) -> ClusterReport:
        return {}

    def close(self) -> None:
        pass


class Emulated:
    """Every worker on its own emulated node (psarch.cluster.emulated), and every service (PS server) on a node of
    its own or beside a worker, on that worker's node (BackendSpec.service_beside)."""

    def __init__(self, cfg: Config) -> None:
        from psarch.cluster.emulated import HUB_ADDRESS, EmulatedCluster

        spec = registry.spec_of(cfg)
        # the services this run starts (PS servers): each on a node of its own, or beside a worker on its node
        self.beside = [spec.service_beside(cfg, i) for i in range(spec.service_nodes(cfg))]
        own = [i for i, w in enumerate(self.beside) if w is None]
        self.own = {i: j for j, i in enumerate(own)}   # service index -> its own node's index
        self.dilation = device.dilation(cfg)           # the links run D times slower than the cluster's
        self.cluster = EmulatedCluster(cfg.backend.world_size, len(own), *device.shaped_mbps(cfg), dilation=self.dilation)
        self.rendezvous_host = HUB_ADDRESS
        from psarch.cluster.alpha import measure_alpha
        w0 = self.cluster.node("worker", 0)     # the hub to a node: one link each way, as a ring's hop
        self.alpha_s = measure_alpha(self.cluster.hub, w0.ns, w0.address)
        self._start = self.cluster.counters()   # links idle: only the kernel's own chatter so far
        self._window: StepWindow[Marks] | None = None

    def context(self) -> BaseContext:
        """Where the run's processes come from: psarch's forkserver (its child enters the namespace of the node the
        launcher's thread is in when it starts it, node()), started to import torch as a node's process must
        (imports_env: c10's log level); where it cannot serve a node, each spawned from inside its node, a fresh
        interpreter that imports torch itself (seconds of CPU per process, in every world's start-up; said in one
        line: psarch.launch.processes.node_context)."""
        return processes.node_context(imports_env(True))

    # The emulated network has no name service: torch's c10d reverse-resolves every address it connects to or
    # accepts from, and warns once per process that it cannot ("The hostname of the client socket cannot be
    # retrieved", harmless: it then shows the address). Processes on nodes start with c10 logging at ERROR
    # (unless the user set TORCH_CPP_LOG_LEVEL); the launcher, whose torch is loaded already, has its stderr
    # closed while it makes the store (a Python exception still says what failed).
    @contextlib.contextmanager
    def rendezvous(self) -> Iterator[None]:
        from psarch.cluster import netns
        with netns.inside(self.cluster.hub), _stderr_closed():
            yield

    @contextlib.contextmanager
    def node(self, role: str, index: int) -> Iterator[None]:
        from psarch.cluster import netns
        from psarch.cluster.emulated import IFNAME

        env = {"GLOO_SOCKET_IFNAME": IFNAME,   # gloo uses the node's link, whatever the hostname says
               **imports_env(True)}
        with processes.environ(env), netns.inside(self._node(role, index).ns):
            yield

    def host(self, role: str, index: int, default: str) -> str:
        return self._node(role, index).address

    def _node(self, role: str, index: int) -> Node:
        """The node a process runs on: a worker's own; a service's own, or the worker's it is beside."""
        if role != "server":
            return self.cluster.node(role, index)
        worker = self.beside[index]
        if worker is not None:
            return self.cluster.node("worker", worker)
        return self.cluster.node(role, self.own[index])

    def step_marks(self, ranks: int) -> list[StepMarks]:
        """The marks each of `ranks` ranks reaches around its steps; every link is read when all have (once a run)."""
        if self._window is None:
            self._window = StepWindow(self.context(), ranks, self._marks)
        return self._window.marks

    def _marks(self) -> Marks:
        """At a mark: every link's bytes, then its packets and its node's TCP retransmissions."""
        return self.cluster.counters(), self.cluster.wire()

    def worker_lost(self) -> None:
        """A worker died and the run goes on: the others must not wait for it at the last mark."""
        if self._window is not None:
            self._window.abort()

    def report(self) -> ClusterReport:
        """Bytes each node's link carried (kernel counters: TCP/IP and Ethernet headers included); each
        node's link_mbps is the rate its link was shaped to (the cluster's / `dilation`); alpha_s is the
        host's, as measured (the cluster's is alpha_s / dilation).
        link_sent/received: over the steps alone, from before the first step to after the last, as the
        per-step meters count (`counted_over` says "run" where a lost worker left no such window);
        run_link_sent/received: the whole run, rendezvous, initial broadcast and final export included;
        link_packets_sent/received, retransmitted_segments: over the steps' window (absent without one), what
        the link's bytes hold beside the messages: each packet's headers, and the payload TCP sent again."""
        now = self.cluster.counters()
        window = self._window.steps() if self._window is not None else None
        nodes: list[NodeReport] = []
        for n in self.cluster.nodes:
            (s0, r0), (s1, r1) = self._start[n.ns], now[n.ns]
            run = {"run_link_sent": s1 - s0, "run_link_received": r1 - r0}
            node = n.to_dict()
            if window is not None:
                (s0, r0), (s1, r1) = window[0][0][n.ns], window[1][0][n.ns]
                (p0, q0, t0), (p1, q1, t1) = window[0][1][n.ns], window[1][1][n.ns]
                node["link_packets_sent"], node["link_packets_received"] = p1 - p0, q1 - q0
                node["retransmitted_segments"] = t1 - t0
            node["link_sent"], node["link_received"] = s1 - s0, r1 - r0
            node["run_link_sent"], node["run_link_received"] = run["run_link_sent"], run["run_link_received"]
            nodes.append(node)
        return {"emulated": True, "alpha_s": self.alpha_s, "dilation": self.dilation,
                "counted_over": "steps" if window else "run",
                "nodes": nodes}

    def close(self) -> None:
        if self._window is not None:
            self._window.close()
        self.cluster.close()


@contextlib.contextmanager
def _stderr_closed() -> Iterator[None]:
    """File descriptor 2 on /dev/null for the block (C++ writes there directly, not through sys.stderr)."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


Placement = Loopback | Emulated   # what the launcher and the PS services are given


def imports_env(emulate: bool) -> dict[str, str]:
    """What a run's processes must find in their environment when they import torch (psarch.launch.processes'
    forkserver imports it for them): on an emulated cluster, c10 logging at ERROR unless the user set its level
    (the name lookups that cannot succeed there, above); on loopback, nothing."""
    return {"TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")} if emulate else {}


@contextlib.contextmanager
def place(cfg: Config) -> Iterator[Placement]:
    """The placement of a run's processes, removed when the block ends (normally or not)."""
    if not cfg.cluster.emulate:
        yield Loopback()
        return
    import multiprocessing.resource_tracker as rt
    rt.ensure_running()   # started by the first spawn otherwise: inside a node, and killed with it
    p = Emulated(cfg)
    try:
        yield p
    finally:
        p.close()
