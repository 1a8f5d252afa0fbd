"""ZeRO's step as a program (psarch.theory.program), on collective's ring passes. Stages 1-2: backward readies
the gradient buckets, each reduce-scattered (1 pass) from backward's hooks (overlap_comm) or after backward, then
the optimizer step on the rank's shard and the all-gather of the updated parameters (1 pass, in buckets), which
nothing hides (zero/stage12.py's gather_params).

Stage 3 is written as what a rank's main thread does, in order (a script: `Act`s), played by `sharded`: it issues
all-gathers and reduce-scatters on its communicator, whose thread runs them one after another in the order issued
(FIFO), blocks on one until it is done, and computes. `zero3_script` is zero/stage3.py's schedule, unit by unit:
forward gathers the root, prefetches the next units up to prefetch_bucket_size elements as each unit starts, and
computes the blocks, then the root's share (its head); backward gathers the root again, prefetches the last units,
computes the root's share first, then each block in reverse (gathered, or waited for, as its backward starts), and
reduce-scatters a block's gradients as its backward ends (at most MAX_IN_FLIGHT left in flight; without
overlap_comm each blocks), the root's last, after backward. `fsdp_script` is FSDP2's (prefetch of k units, the root
kept gathered). A unit's frozen weights (train.trainable, LoRA's base; `frozen`: each unit's bytes) are all-gathered
after its trainable ones, in a collective of their own, both times, and never reduce-scattered; a unit of frozen
weights only reduces nothing. A unit backward never reaches (it trains nothing, nor does any before it: `reached`)
has no backward: psarch's ZeRO-3 does not gather it there, FSDP2 only where the unit after it prefetches it.
Both take the units in the order forward runs them (zero/spec.py's _units), and neither has a unit forward never runs.
Compute is shared among units by the bytes they gather (backward's among the units it reaches)."""
from __future__ import annotations

from dataclasses import dataclass

from collective.program import TableServers, bucketed, placed, rank_layout, row_pushes
from psarch.theory.program import DataStep, Program


def stage12_program(n: int, buckets: list[float], gathers: list[float], step: DataStep, overlap: bool,
                    reduced: bool = False, reduce_passes: int = 1, tables: TableServers | None = None,
                    grad_share: float = 1.0) -> Program:
    """Reduce-scatter of `buckets` (bytes, in the order backward readies them), the optimizer, the all-gather of
    `gathers` (bytes, in order) among n ranks. reduce_passes = 2: each bucket all-reduced instead (torch's DDP
    under ZeroRedundancyOptimizer, whose broadcasts of the updated shards move what one all-gather pass does);
    `tables`: embedding rows on PS servers beside it (the hybrid); grad_share: the share of a bucket's bytes its
    reduce-scatter moves (0.5: train.compression casts fp32 gradients to 2 bytes, zero/wire.py)."""
    p, last = bucketed(n, buckets, step, overlap, reduced, "rs", reduce_passes, tables, grad_share)
    layout = rank_layout(n, reduced, tables)   # as bucketed lays the ranks out
    for b, size in enumerate(gathers):
        last = [(d,) for d in layout.ring(p, f"ag{b}", size, 1, list(last))]
    return p


@dataclass(frozen=True)
class Act:
    """One thing a rank's main thread does: GATHER or REDUCE (issue an all-gather or a reduce-scatter of `value`
    bytes on the communicator, run in the order issued), WAIT (block until collective `name` is done) or COMPUTE
    (`value` seconds, once every collective waited for since the last compute is done)."""

    kind: str
    name: str
    value: float = 0.0


GATHER, REDUCE, WAIT, COMPUTE = "gather", "reduce", "wait", "compute"


def sharded(n: int, script: list[Act], reduced: bool = False, optimizer_s: float = 0.0,
            tables: TableServers | None = None) -> Program:
    """The program of n ranks each acting out `script` (every rank alike; reduced: one node standing for them), then
    the optimizer step once every collective is done; `tables`: embedding rows on PS servers beside it (the hybrid;
    reduced: its rings step by step, collective/program.py's Ranks), each rank's pulled before its first collective
    and pushed after its last compute."""
    layout = rank_layout(n, reduced, tables)
    p, where, comm = placed(layout, tables)   # comm: the communicator's last op on each rank
    ranks = layout.nodes
    at: list[tuple[str, ...]] = [() for _ in ranks]      # what the main thread has done since (and with) its last span
    issued: dict[str, list[str]] = {}
    last = ["" for _ in ranks]
    for act in script:
        if act.kind in (GATHER, REDUCE):
            got = layout.ring(p, act.name, act.value, 1, [(*comm[j], *at[j]) for j in ranks])
            comm, issued[act.name] = [(g,) for g in got], got
        elif act.kind == WAIT:
            at = [(*at[j], issued[act.name][j]) for j in ranks]
        else:
            last = [p.compute(f"{act.name}.{r}", r, act.value, at[j]) for j, r in enumerate(ranks)]
            at = [(x,) for x in last]
    pushed = row_pushes(p, layout, tables, where, last) if tables else [() for _ in ranks]
    for j, r in enumerate(ranks):
        p.compute(f"opt{r}", r, optimizer_s, (*at[j], *comm[j], *pushed[j]))
    return p


def fsdp_script(units: list[float], step: DataStep, prefetch: int = 0, keep_first: bool = False,
                frozen: list[float] | None = None, grad_share: float = 1.0,
                reached: list[bool] | None = None) -> list[Act]:
    """FSDP2's step over `units` (each unit's trainable parameter bytes, in forward order; `frozen`: its frozen
    bytes): in forward and in backward (in reverse), all-gather each unit, compute it; reduce-scatter a unit's
    gradients once its backward is done. prefetch = k: a unit's all-gather is issued as the unit k before it starts
    computing (FSDP2 prefetches one), not after the unit before it is done; keep_first: the first unit (FSDP2's
    root) stays gathered from forward through backward; grad_share: each reduce-scatter's share of its unit's bytes
    (0.5: fp32 gradients reduced in 2 bytes, FSDP2's reduce_dtype). `reached`: whether backward reaches each unit
    (all: None); one it does not has no backward and is gathered there only where a unit it reaches prefetches it
    (FSDP2's unit after it, which prefetches the one before it in forward's order, whether backward reaches that or
    not)."""
    frozen = frozen or [0.0] * len(units)
    reached = reached or [True] * len(units)
    share = _shares(units, frozen)
    back = _shares(units, frozen, reached)
    out: list[Act] = []
    issued_to = -1
    for i in range(len(units)):
        while issued_to < min(len(units) - 1, i + prefetch):   # issued as the unit `prefetch` before it starts
            issued_to += 1
            out += _gather(f"fag{issued_to}", units[issued_to], frozen[issued_to])
        out += [*_wait(f"fag{i}", units[i], frozen[i]), Act(COMPUTE, f"fwd{i}", step.forward_s * share[i])]
    first = 1 if keep_first else 0
    issued_to = len(units)
    for i in [k for k in reversed(range(len(units))) if reached[k]]:
        while issued_to > max(first, i - prefetch):
            issued_to -= 1
            if any(reached[issued_to:issued_to + prefetch + 1]):   # reached, or prefetched by a unit that is
                out += _gather(f"bag{issued_to}", units[issued_to], frozen[issued_to])
        out += [*_wait(f"bag{i}" if i >= first else f"fag{i}", units[i], frozen[i]),
                Act(COMPUTE, f"bwd{i}", step.backward_s * back[i])]
        out += [Act(REDUCE, f"rs{i}", units[i] * grad_share)] if units[i] else []
    return out


def _shares(units: list[float], frozen: list[float], reached: list[bool] | None = None) -> list[float]:
    """Each unit's share of the compute: of the bytes it gathers (`reached`: among the units backward reaches)."""
    gathered = [u + f if reached is None or reached[i] else 0.0 for i, (u, f) in enumerate(zip(units, frozen))]
    return [g / (sum(gathered) or 1.0) for g in gathered]


def _gather(name: str, trains: float, frozen: float) -> list[Act]:
    """A unit's all-gathers, as zero/stage3.py issues them: its trainable parameters' (where it has any), then its
    frozen ones' (where it has any)."""
    return ([Act(GATHER, name, trains)] if trains else []) + ([Act(GATHER, name + "f", frozen)] if frozen else [])


def _wait(name: str, trains: float, frozen: float) -> list[Act]:
    return [Act(WAIT, x.name) for x in _gather(name, trains, frozen)]


class _Stage3Script:
    """The actions of zero3_script as they are taken: gathers (each unit's at most once while it stays on its way),
    waits, prefetch windows and the reduce-scatters left in flight."""

    def __init__(self, units: list[float], frozen: list[float], prefetch_bytes: float, overlap: bool,
                 in_flight: int, grad_share: float) -> None:
        self.units, self.frozen, self.prefetch_bytes = units, frozen, prefetch_bytes
        self.overlap, self.in_flight, self.grad_share = overlap, in_flight, grad_share
        self.out: list[Act] = []
        self.on_way: set[int] = set()
        self.pending: list[str] = []

    def gather(self, i: int, tag: str) -> None:
        self.on_way.add(i)
        self.out.extend(_gather(f"{tag}{i}", self.units[i], self.frozen[i]))

    def ensure(self, i: int, tag: str) -> None:
        if i not in self.on_way:
            self.gather(i, tag)
        self.out.extend(_wait(f"{tag}{i}", self.units[i], self.frozen[i]))

    def prefetch(self, order: list[int], tag: str) -> None:
        budget = self.prefetch_bytes
        for i in order:
            if budget <= 0:
                return
            if i not in self.on_way:
                self.gather(i, tag)
            budget -= self.units[i] + self.frozen[i]

    def reduce(self, i: int) -> None:
        if not self.units[i]:   # a unit of frozen weights only reduces nothing
            return
        self.out.append(Act(REDUCE, f"rs{i}", self.units[i] * self.grad_share))
        if not self.overlap:
            self.out.append(Act(WAIT, f"rs{i}"))
            return
        self.pending.append(f"rs{i}")
        while len(self.pending) > self.in_flight:
            self.out.append(Act(WAIT, self.pending.pop(0)))


def zero3_script(units: list[float], step: DataStep, prefetch_bytes: float, overlap: bool,
                 in_flight: int, frozen: list[float] | None = None, grad_share: float = 1.0,
                 reached: list[bool] | None = None) -> list[Act]:
    """zero/stage3.py's step over `units` (trainable bytes of each, the root first, then the blocks in forward order;
    `frozen`: each unit's frozen bytes, padded as zero/frozen.py shards them):
    `prefetch_bytes` (prefetch_bucket_size's elements in bytes) gathered ahead of use, each window counting the
    units already on their way (Stage3._prefetch); reduce-scatters asynchronous (overlap: at most `in_flight` left
    in flight, the oldest waited for beyond: Stage3._reap) or blocking, each of grad_share x its unit's bytes (0.5:
    train.compression casts fp32 gradients to 2 bytes, zero/wire.py). Compute shared by bytes, the root's at
    forward's end and backward's start (its head). `reached`: whether backward reaches each unit (all: None); one it
    does not (no parameter that trains in it or before it) is neither gathered nor prefetched there, and backward's
    compute is shared among those it reaches."""
    frozen = frozen or [0.0] * len(units)
    reached = reached or [True] * len(units)
    share = _shares(units, frozen)
    back = _shares(units, frozen, reached)
    blocks = list(range(1, len(units)))
    s = _Stage3Script(units, frozen, prefetch_bytes, overlap, in_flight, grad_share)
    s.ensure(0, "fag")
    s.prefetch(blocks, "fag")
    for pos, i in enumerate(blocks):
        s.ensure(i, "fag")
        s.prefetch(blocks[pos + 1:], "fag")
        s.out.append(Act(COMPUTE, f"fwd{i}", step.forward_s * share[i]))
    s.out.append(Act(COMPUTE, "fwd0", step.forward_s * share[0]))
    s.on_way.clear()   # every unit freed after its forward, the root after the model's
    backward = [i for i in blocks[::-1] if reached[i]]
    s.ensure(0, "bag")
    s.prefetch(backward, "bag")
    s.out.append(Act(COMPUTE, "bwd0", step.backward_s * back[0]))
    for pos, i in enumerate(backward):
        s.ensure(i, "bag")
        s.prefetch(backward[pos + 1:], "bag")
        s.out.append(Act(COMPUTE, f"bwd{i}", step.backward_s * back[i]))
        s.reduce(i)
    s.reduce(0)
    return s.out + [Act(WAIT, x) for x in s.pending]


def stage3_program(n: int, units: list[float], step: DataStep, reduced: bool = False, prefetch: int = 0,
                   keep_first: bool = False, tables: TableServers | None = None,
                   frozen: list[float] | None = None, grad_share: float = 1.0,
                   reached: list[bool] | None = None) -> Program:
    """FSDP2's ZeRO-3 step (fsdp_script) among n ranks; `tables`: embedding rows on PS servers beside it."""
    return sharded(n, fsdp_script(units, step, prefetch, keep_first, frozen, grad_share, reached), reduced,
                   step.optimizer_s,
                   tables)
