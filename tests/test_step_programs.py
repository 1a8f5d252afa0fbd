"""Each backend's step program (collective/program.py, zero/program.py, psarch/ps/program.py) simulated in full
(every rank and server its own node and ops) and by its reduction (one node standing for alike ones) agrees
within 1% at every N from 2 to 9 and at 12, 13, 16, 17, 24, 31 and 32 (odd and even, powers of two and not; the
full program's time grows as N squared), with latency, compute and overlap in play. The programs a spec writes from a
config, timed against their formulas: test_step_program_bytes.py, test_step_program_compression.py and
test_step_program_embeddings.py."""
from __future__ import annotations

import pytest

from collective.program import ALL_TO_ALL, TableServers, bucketed, collectives, ddp_program
from psarch.dp.program import dp_program
from psarch.ps.program import CommitBytes, RowBytes, Slot, groups_of, held_slots, ps_program, ps_reduced
from psarch.theory.program import Cluster, DataStep, chunks
from psarch.theory.simulate import simulate
from zero.program import sharded, stage12_program, stage3_program, zero3_script

RATE, ALPHA = 1e9, 2e-5
STEP = DataStep.of(0.05)
S = 40e6          # bytes of gradients
UNITS = [S / 10] + [0.225 * S] * 4   # ZeRO-3's root and 4 blocks
SIZES = [*range(2, 10), 12, 13, 16, 17, 24, 31, 32]
SLOTS = [Slot(S / 8 / 4, (i + 1) / 4) for i in range(4)]   # a server's 4 partitions, ready through backward


def ps(k: int | str, colocated: bool = False, uneven: bool = False, barrier: bool = True, local_steps: int = 1,
       rows: bool = False, replicas: int = 0):
    """The PS with k servers of SLOTS each (uneven: every other one a partition short, as round robin deals);
    barrier = False: async; local_steps: GEO's; rows: embedding rows pulled before forward, pushed after backward;
    replicas: each server's slots held by the next r servers too (chain replication)."""
    def write(n: int, reduced: bool):
        count = n if k == "n" else (max(1, n // 2) if k == "n/2" else int(k))
        servers = [SLOTS[:3] if uneven and j % 2 else SLOTS for j in range(count)]
        servers = held_slots(servers, replicas) if replicas else servers
        rb = RowBytes(8e3 / count, S / 16 / count, S / 16 / count) if rows else None
        cb = CommitBytes(50.0, 17.0) if replicas else None
        if reduced:
            return ps_reduced(n, groups_of(servers), colocated, STEP, barrier, local_steps, rb, cb)
        return ps_program(n, servers, colocated, STEP, barrier, local_steps, rb, cb)
    return write


def compressed_ddp(later: bool):
    """4 buckets, each: a top-k all-gather (1 pass over n pairs' worth), or PowerSGD's whole and P all-reduced as
    it fills and its Q after backward (later) or right after P (torch's hook)."""
    def write(n: int, reduced: bool):
        sizes = chunks(S, S / 4)
        if not later:
            launched = [[(f"tk{b}", n * size / 50, 1)] for b, size in enumerate(sizes)]
            return collectives(n, sizes, launched, [], STEP, True, reduced)[0]
        launched = [[(f"w{b}", size / 20, 2), (f"p{b}", size / 10, 2)] for b, size in enumerate(sizes)]
        return collectives(n, sizes, launched, [(f"q{b}", size / 10, 2) for b, size in enumerate(sizes)], STEP,
                           True, reduced)[0]
    return write


def ps_compressed(n: int, reduced: bool):
    """The PS with n servers whose pushes carry a tenth of the pulls' bytes (top-k)."""
    servers = [[Slot(x.bytes, x.ready, x.bytes / 10) for x in SLOTS] for _ in range(n)]
    return ps_reduced(n, groups_of(servers), False, STEP) if reduced else ps_program(n, servers, False, STEP)


def embedding_rows(sharded: bool):
    """Dense buckets all-reduced from backward's hooks and embedding rows beside them: all-gathered after backward,
    or (sharded) all-to-all before forward and after backward."""
    def write(n: int, reduced: bool):
        sizes = chunks(S / 4, S / 16)
        dense = [[(f"ar{b}", size, 2)] for b, size in enumerate(sizes)]
        if sharded:
            before = [("counts", 24.0 * (n - 1), ALL_TO_ALL), ("ids", 8e4, ALL_TO_ALL), ("rows", S / 8, ALL_TO_ALL)]
            return collectives(n, sizes, dense, [("grads", S / 8, ALL_TO_ALL)], STEP, True, reduced, before)[0]
        later = [("counts", n * 24.0, 1), ("ids", n * 8e4, 1), ("rows", n * S / 8, 1)]
        return collectives(n, sizes, dense, later, STEP, True, reduced)[0]
    return write


def hybrid(dense: str, k: int | str, colocated: bool = False):
    """The hybrid: `dense` ("ddp", "zero-1/2", "zero-3") over the dense layers, each rank's embedding rows pulled
    from k table servers (dedicated or colocated) before forward and their gradients pushed after backward."""
    def write(n: int, reduced: bool):
        count = n if k == "n" else (max(1, n // 2) if k == "n/2" else int(k))
        tables = TableServers(count, colocated, RowBytes(8e3 / count, S / 16 / count, S / 16 / count))
        sizes = chunks(S / 4, S / 16)
        if dense == "ddp":
            return bucketed(n, sizes, STEP, True, reduced, "ar", 2, tables)[0]
        if dense == "zero-1/2":
            return stage12_program(n, sizes, chunks(S / 4, S / 8), STEP, True, reduced, tables=tables)
        return sharded(n, zero3_script([u / 4 for u in UNITS], STEP, 0.05 * S, True, 2), reduced, tables=tables)
    return write


PROGRAMS = {
    "ddp, embedding rows all-gathered": embedding_rows(False),
    "ddp, embedding rows sharded (all-to-all)": embedding_rows(True),
    "ddp, top-k all-gather": compressed_ddp(False),
    "ddp, PowerSGD": compressed_ddp(True),
    "ps, n servers, compressed pushes": ps_compressed,
    "ddp, overlap": lambda n, r: ddp_program(n, chunks(S, S / 4), STEP, True, r),
    "ddp, after backward": lambda n, r: ddp_program(n, chunks(S, S / 3), STEP, False, r),
    "zero-1/2": lambda n, r: stage12_program(n, chunks(S, S / 3), chunks(S, S / 2), STEP, True, r),
    "zero-3": lambda n, r: stage3_program(n, [S / 3] * 3, STEP, r),
    "zero-3, FSDP2's prefetch and root": lambda n, r: stage3_program(n, [S / 6, S / 3, S / 3, S / 6], STEP, r,
                                                                     prefetch=1, keep_first=True),
    "zero-3, the trainer's units, prefetch of one": lambda n, r: sharded(n, zero3_script(UNITS, STEP, 0.2 * S, True, 2),
                                                                         r),
    "zero-3, the trainer's units, all prefetched": lambda n, r: sharded(n, zero3_script(UNITS, STEP, S, True, 2), r),
    "zero-3, the trainer's units, no prefetch, blocking": lambda n, r: sharded(n, zero3_script(UNITS, STEP, 0, False, 2),
                                                                               r),
    "dp, copies to and from the master": lambda n, r: dp_program(n, S, STEP, r),
    "torch_zero": lambda n, r: stage12_program(n, chunks(S, S / 3), [S], STEP, True, r, reduce_passes=2),
    "ps, 1 server": ps(1),
    "ps, 2 servers": ps(2),
    "ps, n servers": ps("n"),
    "ps, n colocated": ps("n", colocated=True),
    "ps, n/2 colocated": ps("n/2", colocated=True),
    "ps, n servers, uneven": ps("n", uneven=True),
    "ps, n colocated, uneven": ps("n", colocated=True, uneven=True),
    "ps async, 2 servers": ps(2, barrier=False),
    "ps, embedding rows, 2 servers": ps(2, rows=True),
    "ps, embedding rows, n/2 colocated, uneven": ps("n/2", colocated=True, uneven=True, rows=True),
    "ps async, n/2 colocated, uneven": ps("n/2", colocated=True, uneven=True, barrier=False),
    "ps geo, k = 3, n servers": ps("n", local_steps=3),
    "ps geo without barrier, k = 3, n colocated": ps("n", colocated=True, barrier=False, local_steps=3),
    "ps, n servers, r = 1": ps("n", replicas=1),
    "ps, 3 servers, r = 2, uneven": ps(3, uneven=True, replicas=2),
    "ps, n colocated, r = 1, uneven": ps("n", colocated=True, uneven=True, replicas=1),
    "hybrid ddp, 2 servers": hybrid("ddp", 2),
    "hybrid ddp, n servers": hybrid("ddp", "n"),
    "hybrid ddp, n/2 colocated": hybrid("ddp", "n/2", colocated=True),
    "hybrid ddp, n colocated": hybrid("ddp", "n", colocated=True),
    "hybrid ddp, 1 colocated": hybrid("ddp", 1, colocated=True),
    "hybrid zero-1/2, 2 servers": hybrid("zero-1/2", 2),
    "hybrid zero-1/2, n/2 colocated": hybrid("zero-1/2", "n/2", colocated=True),
    "hybrid zero-3, 2 servers": hybrid("zero-3", 2),
    "hybrid zero-3, n/2 colocated": hybrid("zero-3", "n/2", colocated=True),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_full_and_reduced_agree_within_1_percent(name):
    write = PROGRAMS[name]
    for n in SIZES:
        full, reduced = write(n, False), write(n, True)
        a = simulate(full, Cluster.of(full, RATE, ALPHA)).step_s
        b = simulate(reduced, Cluster.of(reduced, RATE, ALPHA)).step_s
        assert b == pytest.approx(a, rel=0.01), f"{name} at N = {n}: full {a:.6g} s, reduced {b:.6g} s"
