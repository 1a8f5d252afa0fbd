"""Collective data parallelism's step as a program (psarch.theory.program): forward, backward readying the
gradient buckets in order, each bucket all-reduced by ring (2 passes of N - 1 steps, one bucket after another on
the communicator) from backward's hooks (overlap_comm) or after backward, then the optimizer step.

`ring` writes one ring pass (or several back to back) for any collective: in full, every rank sends 1/N of the
bytes to the next at each step, once it has the previous step's chunk from the one before; reduced (every rank
alike), one transfer of the pass's (N - 1)/N of the bytes standing for N, its steps as messages in sequence.

Beside embedding tables on PS servers (the hybrid, TableServers) a reduced program keeps the ring's steps
(ring_steps): the row pushes share a rank's link with the ring's steps, taking it whole during each step's α,
which one transfer paying every step's α before its bytes does not time alike (its step parted from the full
one's by 1-1.6% at N = 17-25). Its ranks are then kinds of alike ones (Ranks): every rank, or, with servers
beside the first k < N ranks, those k and the others."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psarch.ps.program import RowBytes, row_pull
from psarch.theory.program import BOTH, SERVER, WORKER, DataStep, Program, backward_spans, ready_points


@dataclass(frozen=True)
class TableServers:
    """Embedding tables on PS servers beside a collective (the hybrid, collective/ps_tables.py): how many servers,
    whether server j sits on rank j's node, and what each rank exchanges with each (psarch/ps/program.py's RowBytes)."""

    servers: int
    colocated: bool
    rows: RowBytes


@dataclass(frozen=True)
class Ranks:
    """Where a program's n ranks are: in full each its own node 0..n-1; reduced one node standing for them all
    (node 0); reduced beside table servers, `kinds`: (node, count) of alike ranks, in ring order, on nodes 0..m-1."""

    n: int
    reduced: bool
    kinds: tuple[tuple[int, int], ...] = ()

    @property
    def nodes(self) -> list[int]:
        return [node for node, _ in self.kinds] if self.kinds else list(range(1 if self.reduced else self.n))

    def ring(self, p: Program, name: str, nbytes: float, passes: int, after: list[tuple[str, ...]]) -> list[str]:
        """`passes` ring passes over `nbytes` among the ranks, each node's starting once `after[i]` is done: the
        op after which each node's ranks have everything."""
        if self.kinds:
            return ring_steps(p, name, self.n, self.kinds, nbytes, passes, after)
        return ring(p, name, self.n, nbytes, passes, after, self.reduced)


def rank_layout(n: int, reduced: bool, tables: TableServers | None = None) -> Ranks:
    """The ranks of a program of n ranks (reduced: alike ones standing as one node; beside `tables`' servers,
    written step by step, the k ranks with a server beside them apart from the others)."""
    if not reduced or not tables:
        return Ranks(n, reduced)
    k = tables.servers
    return Ranks(n, True, ((0, k), (1, n - k)) if tables.colocated and k < n else ((0, n),))


def workers(n: int, reduced: bool) -> Program:
    """A program on n worker nodes (reduced: one node standing for n)."""
    p = Program()
    for count in ([n] if reduced else [1] * n):
        p.node(WORKER, count)
    return p


def ring(p: Program, name: str, n: int, nbytes: float, passes: int, after: list[tuple[str, ...]],
         reduced: bool, nodes: list[int] | None = None, copies: int | None = None) -> list[str]:
    """`passes` ring passes over `nbytes` among ranks 0..n-1 (on `nodes`, default 0..n-1; reduced: nodes[0] stands
    for them all), rank r starting once `after[r]` is done: the op after which each rank has everything (one name
    reduced; `copies`: the alike rings it stands for, default n). Each rank's sends ride its node's ring
    connection."""
    on = nodes or list(range(1 if reduced else n))
    steps = passes * (n - 1)
    if n == 1 or not steps:
        return [p.join(f"{name}.{r}", on[r], after[r]) for r in range(1 if reduced else n)]
    if reduced:
        return [p.transfer(name, on[0], on[0], steps * nbytes / n, ("ring", on[0]), after[0], messages=steps,
                           copies=copies or n)]
    for j in range(steps):
        for r in range(n):
            # a rank sends step j's chunk once it has the one before's, and after its own step j - 1 (its own part
            # of the bytes: a rank that starts late does not send ahead of its first step)
            wait = after[r] if j == 0 else (f"{name}.{j - 1}.{(r - 1) % n}", f"{name}.{j - 1}.{r}")
            p.transfer(f"{name}.{j}.{r}", on[r], on[(r + 1) % n], nbytes / n, ("ring", on[r]), wait)
    # done on a rank once its last chunk is in and its own last send out (the next collective waits for both)
    return [p.join(f"{name}.end{r}", on[r], (f"{name}.{steps - 1}.{(r - 1) % n}", f"{name}.{steps - 1}.{r}"))
            for r in range(n)]


def ring_steps(p: Program, name: str, n: int, kinds: tuple[tuple[int, int], ...], nbytes: float, passes: int,
               after: list[tuple[str, ...]]) -> list[str]:
    """`passes` ring passes over `nbytes` among n ranks standing as `kinds` ((node, count) in ring order), step by
    step: at each step every rank sends 1/n of the bytes to the next (within its kind, the last of a kind to the
    first of the next), the ranks of kind i starting once `after[i]` is done and each later step once the step
    before has reached and left its kind. The op after which each kind's ranks have everything."""
    steps, m = passes * (n - 1), len(kinds)
    if n == 1 or not steps:
        return [p.join(f"{name}.{i}", node, after[i]) for i, (node, _) in enumerate(kinds)]
    # (from kind, to kind, copies): a kind's ranks send within it, its last to the next kind's first
    edges = [(i, i, count - (m > 1)) for i, (_, count) in enumerate(kinds)] + \
        ([(i, (i + 1) % m, 1) for i in range(m)] if m > 1 else [])
    edges = [e for e in edges if e[2]]
    prev: dict[tuple[int, int], str] = {}
    for j in range(steps):
        prev = {(a, b): p.transfer(f"{name}.{j}.{a}.{b}", kinds[a][0], kinds[b][0], nbytes / n,
                                   ("ring", kinds[a][0], kinds[b][0]),
                                   after[a] if j == 0 else tuple(x for e, x in prev.items() if a in e),
                                   copies=copies)
                for a, b, copies in edges}
    return [p.join(f"{name}.end{i}", node, tuple(x for e, x in prev.items() if i in e))
            for i, (node, _) in enumerate(kinds)]


def bucketed(n: int, buckets: list[float], step: DataStep, overlap: bool, reduced: bool, name: str,
             passes: int, tables: TableServers | None = None,
             wire_share: float = 1.0) -> tuple[Program, list[tuple[str, ...]]]:
    """Backward readying `buckets` (bytes, in that order) among n ranks, each bucket `passes` ring passes from
    backward's hooks (overlap) or after backward, one after another, then the optimizer step: the program, and
    each rank's optimizer step (what comes next waits for); `tables`: embedding rows on PS servers beside it;
    `wire_share`: the share of a bucket's bytes its passes move (0.5: fp32 gradients cast to 2 bytes)."""
    return collectives(n, buckets, [[(f"{name}{b}", size * wire_share, passes)] for b, size in enumerate(buckets)],
                       [], step, overlap, reduced, tables=tables)


# one collective: its name, bytes, ring passes over them (ALL_TO_ALL: bytes each rank sends)
Call = tuple[str, float, int]
ALL_TO_ALL = 0


def all_to_all(p: Program, name: str, n: int, nbytes: float, after: list[tuple[str, ...]], reduced: bool) -> list[str]:
    """An all-to-all among ranks 0..n-1 in which each rank sends `nbytes` in all, an equal share to each other rank,
    all at once (one α), rank r starting once `after[r]` is done: the op after which each rank has everything."""
    if n == 1:
        return [p.join(f"{name}.0", 0, after[0])]
    if reduced:
        return [p.transfer(name, 0, 0, nbytes / (n - 1), ("a2a", 0), after[0], copies=n * (n - 1))]
    sends = {(r, d): p.transfer(f"{name}.{r}.{d}", r, d, nbytes / (n - 1), ("a2a", r, d), after[r])
             for r in range(n) for d in range(n) if d != r}
    return [p.join(f"{name}.{r}", r, tuple(x for (a, b), x in sends.items() if r in (a, b))) for r in range(n)]


def collectives(n: int, sizes: list[float], launched: list[list[Call]], later: list[Call], step: DataStep,
                overlap: bool, reduced: bool, before: list[Call] | None = None,
                tables: TableServers | None = None, hooks_s: list[float] | None = None,
                finish_s: float = 0.0) -> tuple[Program, list[tuple[str, ...]]]:
    """Backward readying buckets of `sizes` (gradient bytes, in that order) among n ranks; once bucket b is ready
    (overlap: from backward's hooks; else after backward) the ranks issue `launched[b]`, and after backward
    `later` (PowerSGD's all-reduce of Q, embedding rows' exchange), all on one communicator, each collective after
    the one issued before it; forward waits for `before` (the rows a step's batch reads, fetched). `tables`: each
    rank also pulls its rows from every server before forward and pushes their gradients after backward, beside
    the ring (reduced: its ring step by step, Ranks). hooks_s: seconds each bucket's hook computes as it is ready
    (a compression's, before its collectives), delaying the rest of backward; finish_s: seconds computed after
    backward and the launched collectives, before `later` and the optimizer (PowerSGD's second half, top-k's sums).
    The program, and each rank's optimizer step (what comes next waits for)."""
    layout = rank_layout(n, reduced, tables)
    p, where, last = placed(layout, tables)
    ranks = layout.nodes

    def issue(calls: list[Call], ready: Sequence[str | None]) -> None:
        nonlocal last
        for name, nbytes, passes in calls:
            wait = [(*((ready[r],) if ready[r] else ()), *last[r]) for r in ranks]
            if passes == ALL_TO_ALL and layout.kinds:
                raise ValueError("step program: an all-to-all beside embedding tables on PS servers is not written")
            got = all_to_all(p, name, n, nbytes, wait, reduced) if passes == ALL_TO_ALL else \
                layout.ring(p, name, nbytes, passes, wait)
            last = [(d,) for d in got]

    issue(before or [], [None for _ in ranks])
    points = ready_points(sizes) if overlap else [1.0] * len(sizes)
    spans = [backward_spans(p, r, r, step, points, last[r], hooks_s) for r in ranks]
    for b, calls in enumerate(launched):
        issue(calls, [spans[r][0][b] for r in ranks])
    ends = [p.compute(f"finish{r}", r, finish_s, (spans[r][1], *last[r])) if finish_s else spans[r][1]
            for r in ranks]
    issue(later, ends)
    pushed = row_pushes(p, layout, tables, where, [spans[r][1] for r in ranks]) if tables else [() for _ in ranks]
    return p, [(p.compute(f"opt{r}", r, step.optimizer_s, (ends[r], *last[r], *pushed[r])),) for r in ranks]


def placed(layout: Ranks, tables: TableServers | None) -> tuple[Program, list[int], list[tuple[str, ...]]]:
    """A program with `layout`'s rank nodes and `tables`' servers declared (dedicated: nodes of their own;
    colocated: server j beside rank j, reduced the first kind's), the servers' nodes, and each rank node's row
    pulls from every server but its own (what its forward waits for; none without tables)."""
    if not tables:
        p = workers(layout.n, layout.reduced)
        return p, [], [() for _ in layout.nodes]
    k, p = tables.servers, Program()
    if not layout.reduced:
        for r in range(layout.n):
            p.node(BOTH if tables.colocated and r < k else WORKER)
        where = list(range(k)) if tables.colocated else [p.node(SERVER) for _ in range(k)]
        return p, where, [tuple(row_pull(p, r, w, j, tables.rows, f"{r}.{j}") for j, w in enumerate(where) if w != r)
                          for r in range(layout.n)]
    for node, count in layout.kinds:
        p.node(BOTH if tables.colocated and node == 0 else WORKER, count)
    where = [0] if tables.colocated else [p.node(SERVER, k)]
    return p, where, [(row_pull(p, r, where[0], 0, tables.rows, f"{r}.0", copies),) if copies else ()
                      for r, copies in zip(layout.nodes, row_pairs(layout, tables))]


def row_pairs(layout: Ranks, tables: TableServers) -> list[int]:
    """In a reduced program, the (rank, server) pairs each rank node exchanges rows over: each of its ranks with
    every server but the one beside it."""
    own = [tables.colocated and node == 0 for node in layout.nodes]
    return [count * (tables.servers - mine) for (_, count), mine in zip(layout.kinds, own)]


def row_pushes(p: Program, layout: Ranks, tables: TableServers, where: list[int],
               after: list[str]) -> list[tuple[str, ...]]:
    """Each rank's push of its rows' gradients to every server (but its own) once `after[i]` (its backward) is
    done."""
    if layout.reduced:
        return [(p.transfer(f"rowpush.{r}.0", r, where[0], tables.rows.grads, ("push", r, 0), (after[r],),
                            copies=copies),) if copies else ()
                for r, copies in zip(layout.nodes, row_pairs(layout, tables))]
    return [tuple(p.transfer(f"rowpush.{r}.{j}", r, w, tables.rows.grads, ("push", r, j), (after[r],))
                  for j, w in enumerate(where) if w != r) for r in range(layout.n)]


def ddp_program(n: int, buckets: list[float], step: DataStep, overlap: bool, reduced: bool = False) -> Program:
    """Ring all-reduce of `buckets` (bytes, in the order backward readies them) among n ranks."""
    return bucketed(n, buckets, step, overlap, reduced, "ar", 2)[0]
