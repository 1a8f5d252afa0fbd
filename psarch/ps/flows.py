"""A flow-level model of the sync parameter server's steps on a cluster, for where the closed form's phases
(psarch/ps/theory.py: push, then pull) do not hold: whole ranges pushed from backward's hooks.

A server's range is ready when backward reaches its first element, so ranges are ready one after another.
With dedicated servers that changes nothing: pushes and pulls never share a link's direction. With colocated
servers they do: a node's uplink carries its worker's pushes and its server's pulls, so the pulls of a range
whose round is complete share the link with the pushes of the last range, whose pulls wait for them (the device
crossover study measured such steps far slower than the same pushed after backward). And the workers
fall out of step: the one whose own server holds the last range gets it at once, the others a pull later.

The model replays a few steps of every worker as flows on the nodes' links:
- worker w computes forward, then backward, in which the partition [lo, hi) of a flat vector of `numel`
  elements is ready at backward x (1 - lo / numel) (backward runs from the vector's end at an even rate);
- each push and each pull is a flow from one node's uplink to another's downlink (a node's own server: no
  time), one at a time on each connection (a worker's pushes to one server, a server's pulls to one worker:
  one TCP connection each way), links shared max-min fairly among the flows on them;
- a server answers a partition's pulls once every worker's push of it is in (sync rounds);
- a worker starts its next step once backward is over and every pull is in.
The step time is the median of the later steps' mean over the workers. Not modelled: TCP's own dynamics
(slow start, one flow taking more than its share), a server's compute, α (added by the caller).
"""
from __future__ import annotations

import heapq
import itertools
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

STEPS = 8            # replayed; the first two (filling the links from an idle start) are not counted
DONE = 1e-6          # bytes: a flow with less left is complete


@dataclass
class Flow:
    src: int                          # node
    dst: int
    left: float                       # bytes
    done: Callable[[float], None]     # called with the time it completes


class Links:
    """Flows on the nodes' uplinks and downlinks (bytes/s each), one at a time per connection, max-min fair."""

    def __init__(self, up: list[float], down: list[float]) -> None:
        self.cap = {("up", i): c for i, c in enumerate(up)} | {("down", i): c for i, c in enumerate(down)}
        self.conns: dict[object, deque[Flow]] = defaultdict(deque)

    def send(self, conn: object, flow: Flow) -> None:
        self.conns[conn].append(flow)

    def active(self) -> list[Flow]:
        return [q[0] for q in self.conns.values() if q]

    def rates(self, flows: list[Flow]) -> dict[int, float]:
        """Max-min fair rates (progressive filling): the link with the least share per flow fixes its flows."""
        rate: dict[int, float] = {}
        cap = dict(self.cap)
        on = defaultdict(list)
        for f in flows:
            on[("up", f.src)].append(f)
            on[("down", f.dst)].append(f)
        while len(rate) < len(flows):
            link, share = min(((k, cap[k] / len([f for f in v if id(f) not in rate]))
                               for k, v in on.items() if any(id(f) not in rate for f in v)), key=lambda x: x[1])
            for f in on[link]:
                if id(f) not in rate:
                    rate[id(f)] = share
                    for k in (("up", f.src), ("down", f.dst)):
                        cap[k] -= share
        return rate

    def finish(self, now: float) -> None:
        """Take every complete flow off its connection (its successor starts) and tell it."""
        complete = [q.popleft() for q in self.conns.values() if q and q[0].left <= DONE]
        for f in complete:
            f.done(now)


def step_time(workers: int, server_nodes: list[int], parts: Sequence[tuple[int, int, float]], numel: int,
              compute_s: float, backward_s: float, up: list[float], down: list[float]) -> float:
    """Seconds a step of `workers` workers (worker w on node w) with servers on `server_nodes` (server j's node:
    j < workers is beside worker j), exchanging partitions `parts` (lo, server, bytes) of a flat vector of
    `numel` elements, each node's links `up`[node] and `down`[node] bytes/s."""
    forward = max(0.0, compute_s - backward_s)
    links, seq = Links(up, down), itertools.count()
    events: list[tuple[float, int, Callable[[float], None]]] = []
    starts: dict[int, list[float]] = defaultdict(list)
    pushed: dict[tuple[int, int], int] = defaultdict(int)   # (step, partition) -> pushes in
    left: dict[tuple[int, int], int] = {}                   # (worker, step) -> pulls and backward still to come

    def at(t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(events, (t, next(seq), fn))

    def flow(conn: object, src: int, dst: int, size: float, done: Callable[[float], None], now: float) -> None:
        if src == dst:
            at(now, done)
        else:
            links.send(conn, Flow(src, dst, size, done))

    def start(w: int, t: int, now: float) -> None:
        starts[w].append(now)
        if t == STEPS:
            return
        left[w, t] = len(parts) + 1
        end = now + forward + backward_s
        for j, (lo, s, size) in sorted(enumerate(parts), key=lambda x: -x[1][0]):
            at(end - backward_s * lo / numel, partial(push, w, t, j, s, size))
        at(end, partial(landed, w, t))

    def push(w: int, t: int, j: int, s: int, size: float, now: float) -> None:
        flow(("push", w, s), w, server_nodes[s], size, partial(arrived, t, j), now)

    def arrived(t: int, j: int, now: float) -> None:
        pushed[t, j] += 1
        if pushed[t, j] == workers:
            _, s, size = parts[j]
            for w in range(workers):
                flow(("pull", s, w), server_nodes[s], w, size, partial(landed, w, t), now)

    def landed(w: int, t: int, now: float) -> None:
        left[w, t] -= 1
        if not left[w, t]:
            start(w, t + 1, now)

    for w in range(workers):
        at(0.0, partial(start, w, 0))
    now = 0.0
    while (flows := links.active()) or events:
        rate = links.rates(flows) if flows else {}
        t = min([now + f.left / rate[id(f)] for f in flows] + ([events[0][0]] if events else []))
        for f in flows:
            f.left -= rate[id(f)] * (t - now)
        now = t
        links.finish(now)
        while events and events[0][0] <= now:
            heapq.heappop(events)[2](now)
    periods = [statistics.mean(starts[w][t + 1] - starts[w][t] for w in range(workers)) for t in range(2, STEPS)]
    return statistics.median(periods)
