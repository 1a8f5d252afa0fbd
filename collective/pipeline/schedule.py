"""Pipeline schedules as data: each rank's instruction list for one step, testable without communication.

A model of P = p·v virtual stages runs on p ranks; virtual stage j lives on rank j % p as its model chunk
j // p (v = 1 but for the interleaved schedule). A schedule gives each rank the order of its compute
(forward and backward of micro-batch i on chunk c); `instructions` adds the point-to-point transfers that
surround them, and `simulate` plays every rank's list against the others on a clock (a forward takes t_f,
a backward t_b, a transfer nothing), which yields each rank's busy and idle time and the activations it
holds: the bubble, counted from the instructions, as DeepSpeed's TrainSchedule lets one count it.

- naive: one micro-batch at a time through the whole pipeline (forward, then backward) before the next:
  no two stages ever work at once; idle fraction (p-1)/p.
- gpipe (Huang et al. 2019): every forward, then every backward; idle (p-1)/(m+p-1); holds m micro-batches.
- 1f1b (PipeDream-Flush, Narayanan et al. 2021): stage s runs p-s-1 forwards, then alternates one forward
  and one backward; the same idle (p-1)/(m+p-1), but holds at most p-s micro-batches.
- interleaved (Megatron-LM, Narayanan et al. 2021): 1F1B over v chunks per rank, micro-batches in groups
  of p (m a multiple of p); idle (p-1)/(v·m+p-1).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")

FORWARD, BACKWARD = "forward", "backward"
RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD = "recv_act", "send_act", "recv_grad", "send_grad"


@dataclass(frozen=True)
class Op:
    """One instruction of a rank: `kind` on micro-batch `mb` of the rank's model chunk `chunk`."""

    kind: str
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class Pipe:
    """The shape of a pipeline: p ranks (stages), m micro-batches per step, v model chunks per rank."""

    p: int
    m: int
    v: int = 1

    @property
    def virtual(self) -> int:
        """P = p·v virtual stages."""
        return self.p * self.v

    def stage_of(self, rank: int, chunk: int) -> int:
        """The virtual stage that chunk `chunk` of rank `rank` is."""
        return chunk * self.p + rank

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) of virtual stage `stage`."""
        return stage % self.p, stage // self.p


def compute_order(schedule: str, pipe: Pipe, rank: int) -> list[Op]:
    """Rank `rank`'s forwards and backwards in the order it runs them."""
    p, m = pipe.p, pipe.m
    if schedule not in SCHEDULES:
        raise ValueError(f"backend.schedule = {schedule!r}: allowed values are {', '.join(SCHEDULES)}")
    if schedule != "interleaved" and pipe.v != 1:
        raise ValueError(f"virtual_stages = {pipe.v}: only the interleaved schedule runs several chunks per rank")
    fwd = [Op(FORWARD, i) for i in range(m)]
    bwd = [Op(BACKWARD, i) for i in range(m)]
    if schedule == "naive":
        return [op for i in range(m) for op in (fwd[i], bwd[i])]
    if schedule == "gpipe":
        return fwd + bwd
    if schedule == "1f1b":
        return _one_f_one_b(fwd, bwd, min(p - rank - 1, m))
    if m % p:
        raise ValueError(f"backend.microbatches = {m}: the interleaved schedule takes micro-batches in groups of "
                         f"backend.stages = {p}; use a multiple of {p}")
    n = pipe.v * m
    fwd = [_interleaved(pipe, k, forward=True) for k in range(n)]
    bwd = [_interleaved(pipe, k, forward=False) for k in range(n)]
    return _one_f_one_b(fwd, bwd, min((p - rank - 1) * 2 + (pipe.v - 1) * p, n))


def _one_f_one_b(fwd: list[Op], bwd: list[Op], warmup: int) -> list[Op]:
    """`warmup` forwards, then one forward and one backward in turn, then the backwards left."""
    steady = len(fwd) - warmup
    order = fwd[:warmup]
    for i in range(steady):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[steady:]


def _interleaved(pipe: Pipe, k: int, forward: bool) -> Op:
    """The k-th forward (backward) of a rank in Megatron's interleaved order: p micro-batches on one chunk,
    then the same p on the next chunk (backward: chunks in reverse), then the next group of p."""
    p, v = pipe.p, pipe.v
    chunk = (k // p) % v
    mb = (k // (p * v)) * p + k % p
    return Op(FORWARD if forward else BACKWARD, mb, chunk if forward else v - 1 - chunk)


def instructions(schedule: str, pipe: Pipe, rank: int) -> list[Op]:
    """Rank `rank`'s whole step: its compute order with each activation received before the forward that
    needs it and sent after the forward that makes it, each gradient likewise around the backward."""
    out: list[Op] = []
    last = pipe.virtual - 1
    for op in compute_order(schedule, pipe, rank):
        j = pipe.stage_of(rank, op.chunk)
        if op.kind == FORWARD:
            out += ([Op(RECV_ACT, op.mb, op.chunk)] if j > 0 else []) + [op] + \
                   ([Op(SEND_ACT, op.mb, op.chunk)] if j < last else [])
        else:
            out += ([Op(RECV_GRAD, op.mb, op.chunk)] if j < last else []) + [op] + \
                   ([Op(SEND_GRAD, op.mb, op.chunk)] if j > 0 else [])
    return out


def peer(pipe: Pipe, rank: int, op: Op) -> int:
    """The rank a transfer goes to or comes from: the next virtual stage's for activations out and
    gradients in, the previous one's for activations in and gradients out."""
    j = pipe.stage_of(rank, op.chunk)
    return pipe.place(j + 1 if op.kind in (SEND_ACT, RECV_GRAD) else j - 1)[0]


@dataclass
class Timeline:
    """What simulate() found: per rank, the time it computed and the time it was idle until the step's end
    (the slowest rank's last backward), and the most micro-batch chunks it held activations of at once."""

    makespan: Fraction
    busy: list[Fraction]
    held_peak: list[int]

    def idle_fraction(self, rank: int) -> Fraction:
        return (self.makespan - self.busy[rank]) / self.makespan


def simulate(schedule: str, pipe: Pipe, t_f: Fraction | int = 1, t_b: Fraction | int = 1) -> Timeline:
    """Play every rank's compute order on one clock: an operation starts once its rank is free and its input
    exists (the forward of the previous virtual stage, the backward of the next); transfers are instant.
    Raises RuntimeError if the orders deadlock."""
    t_f, t_b = Fraction(t_f), Fraction(t_b)
    orders = [compute_order(schedule, pipe, r) for r in range(pipe.p)]
    done: dict[tuple[str, int, int], Fraction] = {}   # (kind, mb, virtual stage) -> finish time
    free = [Fraction(0)] * pipe.p
    nxt, busy, held, peak = [0] * pipe.p, [Fraction(0)] * pipe.p, [0] * pipe.p, [0] * pipe.p
    last = pipe.virtual - 1
    while any(nxt[r] < len(orders[r]) for r in range(pipe.p)):
        progressed = False
        for r in range(pipe.p):
            while nxt[r] < len(orders[r]):
                op = orders[r][nxt[r]]
                j = pipe.stage_of(r, op.chunk)
                need = ((FORWARD, op.mb, j - 1) if j > 0 else None) if op.kind == FORWARD else \
                    ((BACKWARD, op.mb, j + 1) if j < last else (FORWARD, op.mb, j))
                if need is not None and need not in done:
                    break
                start = max(free[r], done[need]) if need is not None else free[r]
                cost = t_f if op.kind == FORWARD else t_b
                free[r] = done[(op.kind, op.mb, j)] = start + cost
                busy[r] += cost
                held[r] += 1 if op.kind == FORWARD else -1
                peak[r] = max(peak[r], held[r])
                nxt[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks at p={pipe.p}, m={pipe.m}, v={pipe.v}")
    return Timeline(max(free), busy, peak)


def bubble_fraction(schedule: str, pipe: Pipe) -> Fraction:
    """The idle fraction theory gives: (p-1)/p naive, (p-1)/(m+p-1) GPipe and 1F1B, (p-1)/(v·m+p-1)
    interleaved (forward and backward of a chunk each a fixed time)."""
    p, m, v = pipe.p, pipe.m, pipe.v
    if schedule == "naive":
        return Fraction(p - 1, p)
    return Fraction(p - 1, (v if schedule == "interleaved" else 1) * m + p - 1)
