"""Collective data parallelism's step as a program (psarch.theory.program): forward, backward readying the
gradient buckets in order, each bucket all-reduced by ring (2 passes of N - 1 steps, one bucket after another on
the communicator) from backward's hooks (overlap_comm) or after backward, then the optimizer step.

`ring` writes one ring pass (or several back to back) for any collective: in full, every rank sends 1/N of the
bytes to the next at each step, once it has the previous step's chunk from the one before; reduced (every rank
alike), one transfer of the pass's (N - 1)/N of the bytes standing for N, its steps as messages in sequence."""
from __future__ import annotations

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
            wait = after[r] if j == 0 else (f"{name}.{j - 1}.{(r - 1) % n}",)
            p.transfer(f"{name}.{j}.{r}", on[r], on[(r + 1) % n], nbytes / n, ("ring", on[r]), wait)
    return [f"{name}.{steps - 1}.{(r - 1) % n}" for r in range(n)]


def bucketed(n: int, buckets: list[float], step: DataStep, overlap: bool, reduced: bool, name: str,
             passes: int, tables: TableServers | None = None) -> tuple[Program, list[tuple[str, ...]]]:
    """Backward readying `buckets` (bytes, in that order) among n ranks, each bucket `passes` ring passes from
    backward's hooks (overlap) or after backward, one after another, then the optimizer step: the program, and
    each rank's optimizer step (what comes next waits for); `tables`: embedding rows on PS servers beside it."""
    return collectives(n, buckets, [[(f"{name}{b}", size, passes)] for b, size in enumerate(buckets)], [], step,
                       overlap, reduced, tables=tables)


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
                tables: TableServers | None = None) -> tuple[Program, list[tuple[str, ...]]]:
    """Backward readying buckets of `sizes` (gradient bytes, in that order) among n ranks; once bucket b is ready
    (overlap: from backward's hooks; else after backward) the ranks issue `launched[b]`, and after backward
    `later` (PowerSGD's all-reduce of Q, embedding rows' exchange), all on one communicator, each collective after
    the one issued before it; forward waits for `before` (the rows a step's batch reads, fetched). `tables`: each
    rank also pulls its rows from every server before forward and pushes their gradients after backward, beside
    the ring (always written in full: servers beside ranks make the ranks unlike, and the row pushes share a rank's
    link with the ring's steps, which a reduced ring, paying its messages' α before its bytes, does not time alike:
    its step parted from the full one's by 1-1.6% at N = 17-25). The program, and each rank's optimizer step (what
    comes next waits for)."""
    reduced = reduced and not tables
    p = workers(n, reduced)
    ranks = range(1 if reduced else n)
    where, last = table_servers(p, len(ranks), tables)

    def issue(calls: list[Call], ready: list[str | None]) -> None:
        nonlocal last
        for name, nbytes, passes in calls:
            wait = [(*((ready[r],) if ready[r] else ()), *last[r]) for r in ranks]
            got = all_to_all(p, name, n, nbytes, wait, reduced) if passes == ALL_TO_ALL else \
                ring(p, name, n, nbytes, passes, wait, reduced)
            last = [(d,) for d in got]

    issue(before or [], [None for _ in ranks])
    points = ready_points(sizes) if overlap else [1.0] * len(sizes)
    spans = [backward_spans(p, r, r, step, points, last[r]) for r in ranks]
    for b, calls in enumerate(launched):
        issue(calls, [spans[r][0][b] for r in ranks])
    issue(later, [spans[r][1] for r in ranks])
    pushed = row_pushes(p, n, tables, where, [spans[r][1] for r in ranks]) if tables else [() for _ in ranks]
    return p, [(p.compute(f"opt{r}", r, step.optimizer_s, (spans[r][1], *last[r], *pushed[r])),) for r in ranks]


def table_servers(p: Program, n: int, tables: TableServers | None) -> tuple[list[int], list[tuple[str, ...]]]:
    """The nodes of `tables`' servers in a program of n ranks (written in full where there are tables: dedicated
    servers declared here), and each rank's row pull from every server (what its forward waits for; none without
    tables)."""
    if not tables:
        return [], [() for _ in range(n)]
    k = tables.servers
    if tables.colocated:
        p.nodes[:k] = [(BOTH, 1)] * k
        where = list(range(k))
    else:
        where = [p.node(SERVER) for _ in range(k)]
    return where, [tuple(row_pull(p, r, w, j, tables.rows, f"{r}.{j}") for j, w in enumerate(where) if w != r)
                   for r in range(n)]


def row_pushes(p: Program, n: int, tables: TableServers, where: list[int], after: list[str]) -> list[tuple[str, ...]]:
    """Each rank's push of its rows' gradients to every server once `after[r]` (its backward) is done."""
    return [tuple(p.transfer(f"rowpush.{r}.{j}", r, w, tables.rows.grads, ("push", r, j), (after[r],))
                  for j, w in enumerate(where) if w != r) for r in range(n)]


def ddp_program(n: int, buckets: list[float], step: DataStep, overlap: bool, reduced: bool = False) -> Program:
    """Ring all-reduce of `buckets` (bytes, in the order backward readies them) among n ranks."""
    return bucketed(n, buckets, step, overlap, reduced, "ar", 2)[0]
