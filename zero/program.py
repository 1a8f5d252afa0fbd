"""ZeRO's step as a program (psarch.theory.program), on collective's ring passes. Stages 1-2: backward readies
the gradient buckets, each reduce-scattered (1 pass) from backward's hooks (overlap_comm) or after backward, then
the optimizer step on the rank's shard and the all-gather of the updated parameters (1 pass, in buckets), which
nothing hides (zero/stage12.py's gather_params). Stage 3, per unit: all-gather its parameters, then its forward;
in backward, in reverse, all-gather it again, its backward, then reduce-scatter its gradients, before the
all-gather of the unit before it (one communicator, in the order issued: no pass hides behind compute). A unit's
frozen weights (train.trainable, LoRA's base) are all-gathered with it, both times, and never reduce-scattered."""
from __future__ import annotations

from collective.program import TableServers, bucketed, ring, row_pushes, table_servers, workers
from psarch.theory.program import DataStep, Program


def stage12_program(n: int, buckets: list[float], gathers: list[float], step: DataStep, overlap: bool,
                    reduced: bool = False, reduce_passes: int = 1, tables: TableServers | None = None) -> Program:
    """Reduce-scatter of `buckets` (bytes, in the order backward readies them), the optimizer, the all-gather of
    `gathers` (bytes, in order) among n ranks. reduce_passes = 2: each bucket all-reduced instead (torch's DDP
    under ZeroRedundancyOptimizer, whose broadcasts of the updated shards move what one all-gather pass does);
    `tables`: embedding rows on PS servers beside it (the hybrid)."""
    p, last = bucketed(n, buckets, step, overlap, reduced, "rs", reduce_passes, tables)
    reduced = reduced and not tables   # written in full there (collectives)
    for b, size in enumerate(gathers):
        last = [(d,) for d in ring(p, f"ag{b}", n, size, 1, list(last), reduced)]
    return p


def stage3_program(n: int, units: list[float], step: DataStep, reduced: bool = False, prefetch: int = 0,
                   keep_first: bool = False, tables: TableServers | None = None,
                   frozen: list[float] | None = None) -> Program:
    """ZeRO-3 over `units` (each unit's trainable parameter bytes, in forward order; `frozen`: each unit's frozen
    bytes, gathered with it; compute shared by all its bytes) among n ranks.
    prefetch = k: a unit's all-gather is issued as the unit k before it starts computing (FSDP2 prefetches one),
    not after the unit before it is done; keep_first: the first unit (FSDP2's root) stays gathered from forward
    through backward; `tables`: embedding rows on PS servers beside it (the hybrid: written in full), each rank's
    pulled before forward (before its first gather) and pushed after backward."""
    reduced = reduced and not tables
    p = workers(n, reduced)
    ranks = range(1 if reduced else n)
    frozen = frozen or [0.0] * len(units)
    gathered = [u + f for u, f in zip(units, frozen)]
    share = [g / (sum(gathered) or 1.0) for g in gathered]
    where, comm = table_servers(p, len(ranks), tables)   # comm: the communicator's last op on each rank
    done: dict[str, list[str]] = {}                       # each compute span's name on each rank

    def gather(name: str, i: int, size: float, issued: str | None) -> None:
        nonlocal comm
        got = ring(p, f"{name}{i}", n, size, 1, [(*comm[r], *((done[issued][r],) if issued else ())) for r in ranks],
                   reduced)
        comm, done[f"{name}{i}"] = [(g,) for g in got], got

    def compute(name: str, seconds: float, after: list[tuple[str, ...]]) -> None:
        done[name] = [p.compute(f"{name}.{r}", r, seconds, after[j]) for j, r in enumerate(ranks)]

    issued_to, prev = -1, ""
    for i, size in enumerate(units):
        while issued_to < min(len(units) - 1, i + prefetch):
            issued_to += 1
            # issued once the unit `prefetch` before it starts, i.e. the one before that is done
            at = issued_to - 1 - prefetch
            gather("fag", issued_to, gathered[issued_to], f"fwd{at}" if at >= 0 else None)
        compute(f"fwd{i}", step.forward_s * share[i], [(done[f"fag{i}"][j], *((done[prev][j],) if prev else ()))
                                                       for j, _ in enumerate(ranks)])
        prev = f"fwd{i}"
    first = 1 if keep_first else 0
    issued_to = len(units)
    for i in reversed(range(len(units))):
        while issued_to > max(first, i - prefetch):
            issued_to -= 1
            at = issued_to + 1 + prefetch
            gather("bag", issued_to, gathered[issued_to], f"bwd{at}" if at < len(units) else prev)
        need = f"bag{i}" if i >= first else f"fag{i}"
        compute(f"bwd{i}", step.backward_s * share[i], [(done[need][j], done[prev][j]) for j, _ in enumerate(ranks)])
        prev = f"bwd{i}"
        if units[i]:   # a unit of frozen weights only reduces nothing
            got = ring(p, f"rs{i}", n, units[i], 1, [(*comm[r], done[prev][j]) for j, r in enumerate(ranks)], reduced)
            comm = [(g,) for g in got]
    pushed = row_pushes(p, n, tables, where, done[prev]) if tables else [() for _ in ranks]
    for j, r in enumerate(ranks):
        p.compute(f"opt{r}", r, step.optimizer_s, (done[prev][j], *comm[j], *pushed[j]))
    return p
