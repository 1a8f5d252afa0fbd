"""The sync parameter server's step as a program (psarch.theory.program), from the facts its workers and servers
act on: each server's partitions (psarch/ps/layout.py's server_partitions), where each server runs (a node of
its own, or beside worker j), and whether pushes leave from backward's hooks.

Worker w computes forward, then backward, in which partition [lo, hi) of the flat vector is ready at backward x
(1 - lo / numel) (backward runs from the vector's end); from the hooks each partition is pushed once ready (else
all after backward), on the worker's one connection to its server, in the order they are ready. A server's round
of a partition is complete once every worker's push of it is in; then it answers each worker's pull on its one
connection to that worker. A worker's step ends when backward is over and every pull is in. A server beside
worker w takes w's push and answers w's pull without the link. Not modelled: a server's compute.

Reduced (every server's partitions alike, `slots`): workers alone, servers alone and nodes with both are each one
node standing for all of them, a slot's pushes and pulls one transfer each per pair of such nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

from psarch.theory.program import BOTH, SERVER, WORKER, DataStep, Program, backward_spans


@dataclass(frozen=True)
class Slot:
    """One partition of a server: its bytes, and where in backward (a fraction) it is ready."""

    bytes: float
    ready: float


def slots_of(parts: list[list[tuple[int, int]]], width: int, hooks: bool) -> list[list[Slot]]:
    """Each server's partitions ([lo, hi) of the flat vector) as slots, in the order they are pushed."""
    numel = sum(b - a for server in parts for a, b in server) or 1
    return [sorted((Slot((b - a) * width, 1 - a / numel if hooks else 1.0) for a, b in server),
                   key=lambda s: s.ready) for server in parts]


def symmetric(servers: list[list[Slot]]) -> list[Slot]:
    """The slots every server shares in a symmetric program: slot i of each server, their mean bytes (a server
    without one counts 0, so that the servers' bytes are all there), ready when the last of them is."""
    m = max(len(s) for s in servers)
    return [Slot(sum(s[i].bytes for s in servers if i < len(s)) / len(servers),
                 max(s[i].ready for s in servers if i < len(s))) for i in range(m)]


def ps_program(n: int, servers: list[list[Slot]], colocated: bool, step: DataStep) -> Program:
    """Every worker and server in full: n workers, len(servers) servers (colocated: server j beside worker j)."""
    k = len(servers)
    p = Program()
    for w in range(n):
        p.node(BOTH if colocated and w < k else WORKER)
    where = list(range(k)) if colocated else [p.node(SERVER) for _ in range(k)]
    order = sorted(((s.ready, j, i) for j, own in enumerate(servers) for i, s in enumerate(own)))
    spans = [backward_spans(p, w, w, step, [x for x, _, _ in order]) for w in range(n)]
    got: list[list[str]] = [[spans[w][1]] for w in range(n)]
    for at, (_, j, i) in enumerate(order):
        pushes = tuple(spans[w][0][at] if where[j] == w else
                       p.transfer(f"push.{w}.{j}.{i}", w, where[j], servers[j][i].bytes, ("push", w, j),
                                  (spans[w][0][at],)) for w in range(n))
        done = p.join(f"round.{j}.{i}", where[j], pushes)
        for w in range(n):
            got[w].append(done if where[j] == w else
                          p.transfer(f"pull.{j}.{i}.{w}", where[j], w, servers[j][i].bytes, ("pull", j, w), (done,)))
    for w in range(n):
        p.join(f"end{w}", w, tuple(got[w]))
    return p


def ps_reduced(n: int, k: int, slots: list[Slot], colocated: bool, step: DataStep) -> Program:
    """The same step when every one of the k servers holds `slots`: one node per kind (colocated: the k nodes
    with a server and a worker, and the n - k with a worker alone)."""
    p = Program()
    if colocated:
        kinds = [(p.node(BOTH, k), k)] + ([(p.node(WORKER, n - k), n - k)] if n > k else [])
        server, copies_at = 0, k
    else:
        kinds = [(p.node(WORKER, n), n)]
        server, copies_at = p.node(SERVER, k), k
    spans = {node: backward_spans(p, node, node, step, [s.ready for s in slots]) for node, _ in kinds}
    got: dict[int, list[str]] = {node: [spans[node][1]] for node, _ in kinds}
    for i, s in enumerate(slots):
        pushes = []
        for node, count in kinds:
            # each of `count` workers pushes to every server but its own
            copies = count * (copies_at - (1 if node == server else 0))
            if node == server:
                pushes.append(spans[node][0][i])
            if copies:
                pushes.append(p.transfer(f"push.{node}.{i}", node, server, s.bytes, ("push", node), (spans[node][0][i],),
                                         copies=copies))
        done = p.join(f"round.{i}", server, tuple(pushes))
        for node, count in kinds:
            copies = count * (copies_at - (1 if node == server else 0))
            got[node].append(done if not copies else
                             p.transfer(f"pull.{node}.{i}", server, node, s.bytes, ("pull", node), (done,), copies=copies))
    for node, _ in kinds:
        p.join(f"end{node}", node, tuple(got[node]))
    return p
