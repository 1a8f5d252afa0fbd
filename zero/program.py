"""ZeRO's step as a program (psarch.theory.program), on collective's ring passes. Stages 1-2: backward readies
the gradient buckets, each reduce-scattered (1 pass) from backward's hooks (overlap_comm) or after backward, then
the optimizer step on the rank's shard and the all-gather of the updated parameters (1 pass, in buckets), which
nothing hides (zero/stage12.py's gather_params). Stage 3, per unit: all-gather its parameters, then its forward;
in backward, in reverse, all-gather it again, its backward, then reduce-scatter its gradients, before the
all-gather of the unit before it (one communicator, in the order issued: no pass hides behind compute)."""
from __future__ import annotations

from collective.program import bucketed, ring, workers
from psarch.theory.program import DataStep, Program


def stage12_program(n: int, buckets: list[float], gathers: list[float], step: DataStep, overlap: bool,
                    reduced: bool = False, reduce_passes: int = 1) -> Program:
    """Reduce-scatter of `buckets` (bytes, in the order backward readies them), the optimizer, the all-gather of
    `gathers` (bytes, in order) among n ranks. reduce_passes = 2: each bucket all-reduced instead (torch's DDP
    under ZeroRedundancyOptimizer, whose broadcasts of the updated shards move what one all-gather pass does)."""
    p, last = bucketed(n, buckets, step, overlap, reduced, "rs", reduce_passes)
    for b, size in enumerate(gathers):
        last = [(d,) for d in ring(p, f"ag{b}", n, size, 1, list(last), reduced)]
    return p


def stage3_program(n: int, units: list[float], step: DataStep, reduced: bool = False) -> Program:
    """ZeRO-3 over `units` (each unit's parameter bytes, in forward order; compute shared by bytes) among n ranks."""
    p = workers(n, reduced)
    ranks = range(1 if reduced else n)
    share = [u / (sum(units) or 1.0) for u in units]
    last: list[tuple[str, ...]] = [() for _ in ranks]
    comm: list[tuple[str, ...]] = [() for _ in ranks]     # the communicator's last op on each rank
    for i, size in enumerate(units):
        got = ring(p, f"fag{i}", n, size, 1, [(*last[r], *comm[r]) for r in ranks], reduced)
        comm = [(g,) for g in got]
        last = [(p.compute(f"fwd{r}.{i}", r, step.forward_s * share[i], (got[j],)),) for j, r in enumerate(ranks)]
    for i in reversed(range(len(units))):
        got = ring(p, f"bag{i}", n, units[i], 1, [(*last[r], *comm[r]) for r in ranks], reduced)
        last = [(p.compute(f"bwd{r}.{i}", r, step.backward_s * share[i], (got[j],)),) for j, r in enumerate(ranks)]
        comm = [(d,) for d in ring(p, f"rs{i}", n, units[i], 1, list(last), reduced)]
    for r in ranks:
        p.compute(f"opt{r}", r, step.optimizer_s, (*last[r], *comm[r]))
    return p
