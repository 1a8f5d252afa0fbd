"""The one step simulator: plays a step's program (psarch.theory.program) on a cluster and says how long the
step takes and of what it is made.

- A compute span starts once every op it waits for is done and takes its seconds.
- A transfer, once every op it waits for is done, joins its connection's queue (one transfer at a time per
  connection, first ready first served); at the head it pays α per message, then its bytes flow from its
  source's uplink to its destination's downlink.
- Flows share links max-min fairly (progressive filling): the link that offers the least to each of its flows
  fixes their rate, and the rest share what is left. A reduced program's transfer counts copies / count on
  each of its links (psarch.theory.program).
- The step ends when its last op does. Its parts, on the node whose ops end last (the most compute among
  ties): compute (its spans), exposed communication (while it does not compute but one of its transfers, sent
  or received, is queued or moving) and idle (neither: waiting for other nodes).
Not modelled: TCP's own dynamics (slow start, unfair shares), a server's compute.
"""
from __future__ import annotations

import heapq
import itertools
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Hashable

from psarch.theory.program import BOTH, SERVER, Cluster, Compute, Op, Program, Transfer
from psarch.timeline import Span

DONE = 1e-9     # a flow with less than this share of its bytes left is complete


@dataclass(frozen=True)
class StepTime:
    """A simulated step: its seconds and, on its busiest node, compute, exposed communication and idle."""

    step_s: float
    compute_s: float
    exposed_s: float
    idle_s: float

    def per(self, steps: int) -> StepTime:
        """This time and its parts shared among `steps` training steps."""
        return StepTime(self.step_s / steps, self.compute_s / steps, self.exposed_s / steps, self.idle_s / steps)

    def to_dict(self) -> dict[str, float]:
        return {"step_time_s": self.step_s, "compute_s": self.compute_s, "comm_s": self.exposed_s,
                "idle_s": self.idle_s}


class _Flow:
    __slots__ = ("op", "left", "up", "down")

    def __init__(self, op: Transfer, cluster: Cluster) -> None:
        self.op, self.left = op, float(op.bytes)
        # how many alike flows this one stands for on each of its links
        self.up = op.copies / cluster.nodes[op.src].count
        self.down = op.copies / cluster.nodes[op.dst].count


def fair_rates(flows: list[_Flow], cluster: Cluster) -> list[float]:
    """Max-min fair rate of each flow (bytes/s of one copy), by progressive filling over the links."""
    ups, downs = {f.op.src for f in flows}, {f.op.dst for f in flows}
    if len(ups) == len(downs) == len(flows):   # no two share a link (a reduced program's usual case): at once
        return [min(cluster.nodes[f.op.src].up / f.up, cluster.nodes[f.op.dst].down / f.down) for f in flows]
    cap: dict[tuple[str, int], float] = {}
    on: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, f in enumerate(flows):
        cap[("up", f.op.src)] = cluster.nodes[f.op.src].up
        cap[("down", f.op.dst)] = cluster.nodes[f.op.dst].down
        on[("up", f.op.src)].append(i)
        on[("down", f.op.dst)].append(i)
    weight = {k: sum(flows[i].up if k[0] == "up" else flows[i].down for i in v) for k, v in on.items()}
    rate: list[float | None] = [None] * len(flows)
    while on:
        link = min(on, key=lambda k: cap[k] / weight[k])
        share = max(0.0, cap[link] / weight[link])
        for i in on.pop(link):
            rate[i] = share
            f = flows[i]
            for k, w in ((("up", f.op.src), f.up), (("down", f.op.dst), f.down)):
                if k in on:
                    on[k].remove(i)
                    cap[k] -= share * w
                    weight[k] -= w
                    if not on[k]:
                        del on[k]
    return [r if r is not None else 0.0 for r in rate]


def _check(program: Program, cluster: Cluster) -> dict[str, Op]:
    ops: dict[str, Op] = {}
    for op in program.ops:
        if op.name in ops:
            raise ValueError(f"step program: two ops are named {op.name!r}")
        ops[op.name] = op
        nodes = (op.node,) if isinstance(op, Compute) else (op.src, op.dst)
        if any(not 0 <= n < len(cluster.nodes) for n in nodes):
            raise ValueError(f"step program: op {op.name!r} names node {nodes}, the cluster has {len(cluster.nodes)}")
        if isinstance(op, Transfer) and op.src == op.dst and cluster.nodes[op.src].count == 1:
            raise ValueError(f"step program: transfer {op.name!r} goes from node {op.src} to itself: a node's own "
                             f"data takes no link, so leave it out")
    for op in program.ops:
        if missing := [a for a in op.after if a not in ops]:
            raise ValueError(f"step program: op {op.name!r} waits for {missing[0]!r}, which is not in the program")
    return ops


def simulate(program: Program, cluster: Cluster) -> StepTime:
    """Play `program` on `cluster` from idle links and return its step time and parts (per training step: a program
    standing for several, Program.steps, divided by them)."""
    ops, start, end = play(program, cluster)
    return parts(ops, start, end, 0.0, max(end.values(), default=0.0)).per(program.steps)


def play(program: Program, cluster: Cluster, began: dict[str, float] | None = None
         ) -> tuple[dict[str, Op], dict[str, float], dict[str, float]]:
    """Play `program` on `cluster` from idle links: its ops by name, and when each started (became ready) and
    ended; with `began`, also when each transfer reached the head of its connection's queue (its α paid from
    then, its bytes after)."""
    player = _Player(program, cluster, began)
    player.run()
    return player.ops, player.start, player.end


class _Player:
    """One play of a program: each op waits for those it needs, a transfer queues on its connection, the flows
    moving share the links, and events (a compute span's end, a transfer's α paid) come due in time order."""

    def __init__(self, program: Program, cluster: Cluster, began: dict[str, float] | None) -> None:
        self.ops = _check(program, cluster)
        self.cluster, self.began = cluster, began
        self.waiting = {name: len(set(op.after)) for name, op in self.ops.items()}
        self.needed_by: dict[str, list[str]] = defaultdict(list)
        for op in program.ops:   # in program order, so that ops ready at once start in it
            for a in set(op.after):
                self.needed_by[a].append(op.name)
        self.queues: dict[Hashable, deque[Transfer]] = defaultdict(deque)
        self.busy: set[Hashable] = set()
        self.flows: list[_Flow] = []
        self.events: list[tuple[float, int, int, str]] = []   # (time, order, kind 0 end / 1 flow starts, op)
        self.seq = itertools.count()
        self.start: dict[str, float] = {}
        self.end: dict[str, float] = {}
        self.now = 0.0

    def run(self) -> None:
        """Play every op to its end."""
        for name in [n for n, w in self.waiting.items() if not w]:
            self.ready(name)
        rates: list[float] = []
        changed = False
        while self.flows or self.events:
            if changed:   # rates hold until a flow starts or ends
                rates = fair_rates(self.flows, self.cluster)
            self.advance(rates)
            changed = self.finish_flows(rates)
            changed = self.fire_events() or changed
        if stuck := [n for n in self.ops if n not in self.end]:
            raise ValueError(f"step program: op {stuck[0]!r} never ran (its waits form a cycle)")

    def ready(self, name: str) -> None:
        """Op `name` has all it waits for: a compute span starts, a transfer joins its connection's queue."""
        op = self.ops[name]
        self.start[name] = self.now
        if isinstance(op, Compute):
            heapq.heappush(self.events, (self.now + op.seconds, next(self.seq), 0, name))
        else:
            self.queues[op.conn].append(op)
            self.serve(op.conn)

    def serve(self, conn: Hashable) -> None:
        """An idle connection takes the head of its queue: its α is paid before its bytes flow."""
        if conn in self.busy or not self.queues[conn]:
            return
        op = self.queues[conn][0]
        self.busy.add(conn)
        if self.began is not None:
            self.began[op.name] = self.now
        heapq.heappush(self.events, (self.now + self.cluster.alpha_s * op.messages, next(self.seq), 1, op.name))

    def done(self, name: str) -> None:
        """Op `name` ended: its connection serves the next transfer, the ops waiting for it may start."""
        self.end[name] = self.now
        op = self.ops[name]
        if isinstance(op, Transfer):
            self.queues[op.conn].popleft()
            self.busy.discard(op.conn)
            self.serve(op.conn)
        for d in self.needed_by[name]:
            self.waiting[d] -= 1
            if not self.waiting[d]:
                self.ready(d)

    def advance(self, rates: list[float]) -> None:
        """The clock to the next moment a flow may end or an event comes due, every flow's bytes moved with it."""
        t = min([self.now + f.left / r if r > 0 else float("inf") for f, r in zip(self.flows, rates)]
                + ([self.events[0][0]] if self.events else []))
        if t == float("inf"):
            raise ValueError("step program: a transfer can never move (a link of rate 0)")
        for f, r in zip(self.flows, rates):
            f.left -= r * (t - self.now)
        self.now = t

    def finish_flows(self, rates: list[float]) -> bool:
        """End the flows complete now; whether any did."""
        over = [_complete(f, r, self.now) for f, r in zip(self.flows, rates)]
        if not any(over):
            return False
        complete = [f for f, o in zip(self.flows, over) if o]
        self.flows = [f for f, o in zip(self.flows, over) if not o]
        for f in complete:
            self.done(f.op.name)
        return True

    def fire_events(self) -> bool:
        """Take the events due now: a transfer with bytes, its α paid, starts its flow; any other op ends.
        Whether a flow started."""
        started = False
        while self.events and self.events[0][0] <= self.now:
            _, _, kind, name = heapq.heappop(self.events)
            op = self.ops[name]
            if kind == 1 and isinstance(op, Transfer) and op.bytes > 0:
                self.flows.append(_Flow(op, self.cluster))
                started = True
            else:
                self.done(name)
        return started


def _complete(f: _Flow, rate: float, now: float) -> bool:
    """Whether a flow is done: less than DONE of its bytes left, or so little that its time left no longer moves the
    clock (a residue of a fast link late in a step: the loop would stand still at `now` for ever)."""
    return f.left <= DONE * max(1.0, f.op.bytes) or (rate > 0 and now + f.left / rate <= now)


def parts(ops: dict[str, Op], start: dict[str, float], end: dict[str, float], lo: float, hi: float) -> StepTime:
    """A step of hi - lo seconds and, within [lo, hi), the parts of the node whose ops end last (the most compute
    among ties)."""
    compute: dict[int, list[tuple[float, float]]] = defaultdict(list)
    comm: dict[int, list[tuple[float, float]]] = defaultdict(list)
    last: dict[int, float] = defaultdict(float)
    for name, op in ops.items():
        span = (max(lo, start[name]), min(hi, end[name]))
        for node in ((op.node,) if isinstance(op, Compute) else (op.src, op.dst)):
            last[node] = max(last[node], min(hi, end[name]))
            if span[1] > span[0]:
                (compute if isinstance(op, Compute) else comm)[node].append(span)
    if not last:
        return StepTime(0.0, 0.0, 0.0, 0.0)
    node = max(last, key=lambda n: (last[n] >= hi - 1e-12 * max(1.0, hi), _length(compute[n])))
    busy = _length(compute[node])
    exposed = _length(compute[node] + comm[node]) - busy
    return StepTime(hi - lo, busy, exposed, max(0.0, hi - lo - busy - exposed))


def _length(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of `spans`."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def node_names(program: Program) -> list[str]:
    """Each node's name in a timeline: "rank i" for the i-th node with a worker (a measured run's ranks'), "server
    j" for the j-th of servers alone, a reduced node "rank i (xN)" for the N alike ones it stands for."""
    names, ranks, servers = [], 0, 0
    for role, count in program.nodes:
        if role == SERVER:
            name, servers = f"server {servers}", servers + count
        else:
            name, ranks = f"rank {ranks}" + (" + server" if role == BOTH else ""), ranks + count
        names.append(name + (f" (x{count})" if count > 1 else ""))
    return names


def spans(program: Program, cluster: Cluster) -> list[Span]:
    """The step of `program` played on `cluster` from idle links as a timeline: each compute span on its node's
    "compute" lane, each transfer on its source's lane of its destination ("to rank 1"), from the head of its
    connection's queue (α included) to its last byte (time queued behind others of its connection is not drawn).
    Zero-second points (joins, a server's round complete) are left out."""
    began: dict[str, float] = {}
    ops, start, end = play(program, cluster, began)
    names = node_names(program)
    out = []
    for name, op in ops.items():
        if isinstance(op, Compute):
            if end[name] > start[name]:
                out.append(Span(names[op.node], "compute", name, start[name], end[name]))
            continue
        out.append(Span(names[op.src], f"to {names[op.dst]}", name, began[name], end[name]))
    return sorted(out, key=lambda s: (s.start, s.node, s.lane))
