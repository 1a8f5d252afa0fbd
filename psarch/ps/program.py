"""The sync parameter server's step as a program (psarch.theory.program), from the facts its workers and servers
act on: each server's partitions (psarch/ps/layout.py's server_partitions), where each server runs (a node of
its own, or beside worker j), and whether pushes leave from backward's hooks.

Worker w computes forward, then backward, in which partition [lo, hi) of the flat vector is ready at backward x
(1 - lo / numel) (backward runs from the vector's end); from the hooks each partition is pushed once ready (else
all after backward), on the worker's one connection to its server, in the order they are ready. A server's round
of a partition is complete once every worker's push of it is in; then it answers each worker's pull on its one
connection to that worker. A worker's step ends when backward is over and every pull is in. A server beside
worker w takes w's push and answers w's pull without the link. Not modelled: a server's compute.

Reduced: alike servers grouped (groups_of), each group one node standing for its servers (colocated: and the
workers beside them), the workers alone one node; a slot's pushes and pulls one transfer each per pair of nodes.

Chain replication (backend.replicas = r, psarch/ps/replication.py) is the same step over each server's held slots
(held_slots): a worker sends each partition's pushpull to every holder on its connection to that holder, and every
holder answers every worker's pull with the whole partition, so a worker's link and a server's carry (1 + r) x the
bytes of r = 0. A partition's first holder completes its round once every push is in; each of its other holders
(a slot with `first`) once it also has a commit: each worker, once backward is over and the first holder's reply has
come, sends every other holder a `commit` (CommitBytes, on its connection to that holder, behind its pushes), which
the holder acknowledges (behind its pulls to that worker); the first to come decides the round (the worker beside
the first holder where servers are colocated, else any: every worker alike). A worker's step ends once every holder
has answered and acknowledged (ServerLink.settle).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from psarch.ps.partitions import chain
from psarch.theory.program import BOTH, SERVER, WORKER, DataStep, Program, backward_spans


@dataclass(frozen=True)
class Slot:
    """One partition of a server: the bytes of its pull, where in backward (a fraction) it is ready, the bytes
    of its push (None: as its pull; fewer where train.compression compresses pushes), and the bytes compressing
    the push moves in the worker's device memory (top-k's selection, computed as the partition is ready)."""

    bytes: float
    ready: float
    pushed: float | None = None
    work: float = 0.0
    # chain replication: a copy held by another than its first holder, that slot's place (its server, or in a reduced
    # program its group, and its index there)
    first: tuple[int, int] | None = None

    @property
    def push(self) -> float:
        return self.bytes if self.pushed is None else self.pushed


@dataclass(frozen=True)
class RowBytes:
    """What one worker exchanges with one server per exchange for its embedding rows (psarch/ps/worker/rows.py):
    the keys of the rows it reads (with the row pull), the rows answered, then their gradients with their keys
    (the row push, first on its connection)."""

    keys: float
    rows: float
    grads: float


def row_pull(p: Program, w: int, where: int, server: int, rb: RowBytes, name: str, copies: int = 1,
             after: tuple[str, ...] = ()) -> str:
    """Worker node w's row pull from server `server` (index, or group's in a reduced program) on node `where`:
    its keys out, the rows back (the op they end with), on the connections its pushes and pulls ride
    (("push", w, server), ("pull", server, w))."""
    keys = p.transfer(f"rowkeys.{name}", w, where, rb.keys, ("push", w, server), after, copies=copies)
    return p.transfer(f"rows.{name}", where, w, rb.rows, ("pull", server, w), (keys,), copies=copies)


def slots_of(parts: list[list[tuple[int, int]]], width: int, hooks: bool,
             pushed: Callable[[int], float] | None = None,
             pulled: Callable[[int], float] | None = None,
             work: Callable[[int], float] | None = None) -> list[list[Slot]]:
    """Each server's partitions ([lo, hi) of the flat vector) as slots, in the order they are pushed; `pushed`:
    the bytes a push of a partition of so many elements carries (None: as its pull); `pulled`: a pull's (None: the
    partition whole, `width` bytes an element); `work`: the bytes compressing its push moves (None: nothing)."""
    numel = sum(b - a for server in parts for a, b in server) or 1
    return [sorted((Slot((b - a) * width if pulled is None else pulled(b - a), 1 - a / numel if hooks else 1.0,
                         None if pushed is None else pushed(b - a), 0.0 if work is None else work(b - a))
                    for a, b in server), key=lambda s: s.ready) for server in parts]


@dataclass(frozen=True)
class CommitBytes:
    """Chain replication's small messages on the wire (psarch/ps/messages.py): a worker's `commit` to a partition's
    other holder, and that holder's `ack`."""

    commit: float
    ack: float


def held_slots(servers: list[list[Slot]], r: int) -> list[list[Slot]]:
    """Each server's slots with r replicas (partitions.chain: server i's partitions on i + 1, ..., i + r too): its own
    and those of the r servers before it in the ring, in the order they are pushed (by when backward readies them;
    ties: its own first, then the nearer server's: every server alike); a copy names where its first holder's is
    (Slot.first)."""
    k = len(servers)
    held = [sorted(((x.ready, (h - j) % k, j, i) for j in range(k) if h in chain(k, r, j)
                    for i, x in enumerate(servers[j])), key=lambda t: t[:2]) for h in range(k)]
    at = {(j, i): pos for j in range(k) for pos, (_, _, jj, i) in enumerate(held[j]) if jj == j}
    return [[replace(servers[j][i], first=None if j == h else (j, at[j, i]),
                     work=servers[j][i].work if j == h else 0.0)   # a push is compressed once, sent to each holder
             for _, _, j, i in held[h]]
            for h in range(k)]


def groups_of(servers: list[list[Slot]]) -> list[tuple[int, list[Slot]]]:
    """The servers as groups of alike ones for a reduced program: (how many, their slots), servers alike where
    their partitions' bytes are (round robin makes at most two groups: those with one partition more) and, with
    replicas, where each copy's first holder is alike too (refined until it holds); a slot is ready when it is on the
    last of the group's servers."""
    kind = _labels([tuple((round(x.bytes), round(x.push)) for x in own) for own in servers])
    while True:   # a server's copies follow servers of one group each, as every other member's do
        refined = _labels([(kind[j], tuple(None if x.first is None else (kind[x.first[0]], x.first[1]) for x in own))
                           for j, own in enumerate(servers)])
        if max(refined) == max(kind):
            break
        kind = refined
    groups: list[list[int]] = [[] for _ in range(max(kind) + 1)]
    for j, g in enumerate(kind):
        groups[g].append(j)

    def alike(i: int, members: list[int]) -> Slot:
        x = servers[members[0]][i]
        return replace(x, ready=max(servers[m][i].ready for m in members),
                       first=None if x.first is None else (kind[x.first[0]], x.first[1]))
    return [(len(members), [alike(i, members) for i in range(len(servers[members[0]]))]) for members in groups]


def _labels(keys: list) -> list[int]:
    """Each key's class, numbered in the order the classes first appear."""
    first = {v: g for g, v in enumerate(dict.fromkeys(keys))}
    return [first[v] for v in keys]


def local_spans(p: Program, w: int, step: DataStep, slots: list[Slot], local_steps: int,
                first: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """Worker w's compute once `first` is done: local_steps - 1 whole steps (GEO's local ones, which push nothing),
    then a forward and a backward cut where `slots` are ready (backward_spans), each push's compression computed
    there at the device's memory bandwidth."""
    prev: tuple[str, ...] = first
    for t in range(local_steps - 1):
        prev = (p.compute(f"local{w}.{t}", w, step.forward_s + step.backward_s + step.optimizer_s, prev),)
    return backward_spans(p, w, w, step, [x.ready for x in slots], prev, [step.seconds(0.0, x.work) for x in slots])


def ps_program(n: int, servers: list[list[Slot]], colocated: bool, step: DataStep, barrier: bool = True,
               local_steps: int = 1, rows: RowBytes | None = None, commits: CommitBytes | None = None) -> Program:
    """Every worker and server in full: n workers, len(servers) servers (colocated: server j beside worker j).
    barrier = False (async, ssp): a server answers a worker's pull of a partition once that worker's own push of
    it is in, not the round; local_steps = k (GEO): each worker computes k steps, then exchanges (the program
    stands for k steps); rows: each worker pulls its embedding rows from every server before it computes and
    pushes their gradients first after backward; commits: the bytes of a replica's commit and ack (held_slots)."""
    k = len(servers)
    p = Program(steps=local_steps)
    for w in range(n):
        p.node(BOTH if colocated and w < k else WORKER)
    where = list(range(k)) if colocated else [p.node(SERVER) for _ in range(k)]
    order = sorted(((s.ready, j, i) for j, own in enumerate(servers) for i, s in enumerate(own)))
    fetched = [tuple(row_pull(p, w, where[j], j, rows, f"{w}.{j}") for j in range(k) if where[j] != w) if rows else ()
               for w in range(n)]
    spans = [local_spans(p, w, step, [servers[j][i] for _, j, i in order], local_steps, fetched[w]) for w in range(n)]
    got: list[list[str]] = [[spans[w][1]] for w in range(n)]
    for w in range(n):
        got[w] += [p.transfer(f"rowpush.{w}.{j}", w, where[j], rows.grads, ("push", w, j), (spans[w][1],))
                   for j in range(k) if rows and where[j] != w]

    def reply(j: int, i: int, w: int) -> str:   # the op by which worker w has server j's answer to slot i
        return f"round.{j}.{i}" if where[j] == w else f"pull.{j}.{i}.{w}"

    for at, (_, j, i) in enumerate(order):
        slot = servers[j][i]
        pushes = tuple(spans[w][0][at] if where[j] == w else
                       p.transfer(f"push.{w}.{j}.{i}", w, where[j], slot.push, ("push", w, j),
                                  (spans[w][0][at],)) for w in range(n))
        told: dict[int, str] = {}
        if slot.first is not None:   # a replica's round: also once the first commit is in
            fj, fi = slot.first
            cb = _commit_bytes(commits)
            told = {w: p.transfer(f"commit.{w}.{j}.{i}", w, where[j], cb.commit, ("push", w, j),
                                  (reply(fj, fi, w), spans[w][1])) for w in range(n) if where[j] != w}
            first = fj if colocated and fj < n else 0
            pushes += (told[first],) if first in told else (reply(fj, fi, first), spans[first][1])
        done = p.join(f"round.{j}.{i}", where[j], pushes)
        for w in range(n):
            got[w].append(done if where[j] == w else
                          p.transfer(f"pull.{j}.{i}.{w}", where[j], w, slot.bytes, ("pull", j, w),
                                     (done if barrier else pushes[w],)))
        for w, commit in told.items():
            got[w].append(p.transfer(f"ack.{j}.{i}.{w}", where[j], w, _commit_bytes(commits).ack, ("pull", j, w),
                                     (commit,)))
    for w in range(n):
        p.join(f"end{w}", w, tuple(got[w]))
    return p


def _commit_bytes(commits: CommitBytes | None) -> CommitBytes:
    if commits is None:
        raise ValueError("a replica's slots (held_slots) need the bytes of a commit and its ack (CommitBytes)")
    return commits


def ps_reduced(n: int, groups: list[tuple[int, list[Slot]]], colocated: bool, step: DataStep, barrier: bool = True,
               local_steps: int = 1, rows: RowBytes | None = None, commits: CommitBytes | None = None) -> Program:
    """The same step with alike servers grouped (groups_of: how many, their slots): one node per group of servers
    (colocated: with their workers beside them), one for the workers alone, one transfer per slot and pair."""
    p = Program(steps=local_steps)
    if colocated:
        k = sum(c for c, _ in groups)
        servers = [p.node(BOTH, c) for c, _ in groups]
        kinds = [(node, c, g) for g, (node, (c, _)) in enumerate(zip(servers, groups))]
        kinds += [(p.node(WORKER, n - k), n - k, -1)] if n > k else []
    else:
        kinds = [(p.node(WORKER, n), n, -1)]
        servers = [p.node(SERVER, c) for c, _ in groups]
    order = sorted((x.ready, g, i) for g, (_, own) in enumerate(groups) for i, x in enumerate(own))
    # each of a kind's `count` workers exchanges with every server of a group but its own
    pairs = {(node, g): count * (c - (own == g)) for node, count, own in kinds for g, (c, _) in enumerate(groups)}
    fetched = {node: tuple(row_pull(p, node, servers[g], g, rows, f"{node}.{g}", pairs[node, g])
                           for g in range(len(groups)) if pairs[node, g]) if rows else () for node, _, _ in kinds}
    spans = {node: local_spans(p, node, step, [groups[g][1][i] for _, g, i in order], local_steps, fetched[node])
             for node, _, _ in kinds}
    got: dict[int, list[str]] = {node: [spans[node][1]] for node, _, _ in kinds}
    for node, _, _ in kinds:
        got[node] += [p.transfer(f"rowpush.{node}.{g}", node, servers[g], rows.grads, ("push", node, g),
                                 (spans[node][1],), copies=pairs[node, g])
                      for g in range(len(groups)) if rows and pairs[node, g]]

    def reply(g: int, i: int, node: int) -> str:   # the op by which a kind's workers have group g's answer to slot i
        return f"pull.{g}.{i}.{node}" if pairs[node, g] else f"round.{g}.{i}"

    for at, (_, g, i) in enumerate(order):
        slot, where = groups[g][1][i], servers[g]
        copies = {node: pairs[node, g] for node, _, _ in kinds}
        mine: dict[int, list[str]] = {node: [spans[node][0][at]] if own == g else [] for node, _, own in kinds}
        for node, _, _ in kinds:
            if copies[node]:
                mine[node].append(p.transfer(f"push.{node}.{g}.{i}", node, where, slot.push, ("push", node, g),
                                             (spans[node][0][at],), copies=copies[node]))
        told: dict[int, str] = {}
        decide: tuple[str, ...] = ()
        if slot.first is not None:   # a replica's round: also once the first commit is in
            fg, fi = slot.first
            cb = _commit_bytes(commits)
            told = {node: p.transfer(f"commit.{node}.{g}.{i}", node, where, cb.commit, ("push", node, g),
                                     (reply(fg, fi, node), spans[node][1]), copies=copies[node])
                    for node, _, _ in kinds if copies[node]}
            first = servers[fg] if colocated else kinds[0][0]
            decide = (told[first],) if first in told else (reply(fg, fi, first), spans[first][1])
        done = p.join(f"round.{g}.{i}", where, tuple(x for pushes in mine.values() for x in pushes) + decide)
        for node, _, _ in kinds:
            got[node].append(p.transfer(f"pull.{g}.{i}.{node}", where, node, slot.bytes, ("pull", g, node),
                                        (done,) if barrier else tuple(mine[node]), copies=copies[node])
                             if copies[node] else done if barrier else mine[node][0])
        for node, commit in told.items():
            got[node].append(p.transfer(f"ack.{g}.{i}.{node}", where, node, _commit_bytes(commits).ack,
                                        ("pull", g, node), (commit,), copies=copies[node]))
    for node, _, _ in kinds:
        p.join(f"end{node}", node, tuple(got[node]))
    return p
