"""What the parts of one parameter server share, declared in one place: `ServerState`, handed to the pull queue,
the pushes, the snapshots, the deadlines and the rows (each part keeps to itself what no other part reads).

A server holds partitions of the flat vector (`Partition`; backend.partition_mb, one range when it is 0; its range
in partitions, or every k-th partition with backend.partition_assignment = "round_robin"): each is updated,
versioned, clocked and pulled on its own, exactly as a server of its own would be, and shares only the
socket, the process and the checkpoint part with the other partitions of its server.

Facts that follow from the config are properties here (barrier, silence allowed, wire dtype, ...), computed
from `cfg.backend`'s own (psarch/ps/spec.py), never again at a site that uses them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from psarch.config import Config
from psarch.precision import compute_dtype
from psarch.ps import wire
from psarch.ps.errors import PSError, WorkerLost
from psarch.ps.layout import held, one_range, push_dtype
from psarch.ps.messages import pulls_deltas
from psarch.ps.server.rounds import OrderedSum
from psarch.ps.server.updates import RangeState

TRACE_LIMIT = 100_000   # ssp: the most trace events a server records
REPLICA = "replica_"    # how a replica partition's requests and replies are booked in a server's traffic


class AckFields(TypedDict, total=False):
    """What a push's ack says beside its version (Pushes.apply): the push's staleness (barrier-free modes) and
    whether its update was skipped (fp16 inf/nan)."""

    staleness: int
    skipped: bool


@dataclass(eq=False)   # one pull is itself only: removing it from the queue compares identities, not every field
class Pull:
    """A pull waiting until the mode lets `worker` have partition `part`'s parameters for `step`."""

    ident: bytes
    op: str
    worker: int
    step: int
    since: float
    extra: AckFields            # pushpull: what the push's ack would have said
    part: "Partition | None" = None

    @property
    def key(self) -> tuple[int, int | None]:
        """Where ServerState.pending files it: its worker and its partition's first element (None: before init)."""
        return self.worker, self.part.lo if self.part is not None else None


@dataclass
class Round:
    """A barrier round in progress (sync; GEO with the barrier): who pushed, their sum in worker order."""

    sum: OrderedSum
    pushed: set[int] = field(default_factory=set)
    since: float = 0.0            # when its first push arrived
    infs: set[int] = field(default_factory=set)   # fp16: the workers whose push of this round declared inf/nan
    members: frozenset[int] | None = None   # a replica's: the workers its first holder summed (a `commit` said)
    last_skipped: bool = False    # sync: whether the last completed round's update was skipped (fp16)
    last_members: frozenset[int] = frozenset()   # sync: the workers the last completed round summed


@dataclass
class Partition:
    """Elements [lo, hi) of the flat vector, one partition a server holds: its parameters and optimizer
    (`range`), its barrier round, and each worker's pushes applied to it (`clock`: the worker's next step)."""

    lo: int
    hi: int
    range: RangeState
    round: Round
    clock: list[int]
    replica: bool = False   # backend.replicas: a copy of another server's partition, kept as that server keeps it
    # a replica's rounds sum what its first live holder's summed (a `commit` names them), until a worker says the
    # holders before it are dead: it then decides them itself (psarch/ps/replication.py)
    follows: bool = False

    def __post_init__(self) -> None:
        self.follows = self.replica

    def slowest(self, live: set[int]) -> int:
        """The fewest pushes of this partition any live worker has made."""
        return min((self.clock[w] for w in live), default=0)


@dataclass
class ServerState:
    """One server's state: its range of the parameters, the round, the workers' clocks, the waiting pulls."""

    index: int
    cfg: Config
    exit_when_done: bool = False   # standalone: stop once every worker is done (or 10 s after a failure)
    parts: list[Partition] = field(default_factory=list)   # its partitions in flat order; none until initialised
    starts: dict[int, Partition] = field(default_factory=dict)   # each partition by its first element
    size: int = 0                  # elements held: its own vector, the partitions joined (partitions.server_partitions)
    numel: int = 0                 # elements of the whole flat vector the servers hold (its partitions depend on it)
    scratch: torch.Tensor = field(init=False)   # a push's payload (push_dtype), decoded here when not summed in place
    refused_non_finite: list[int] = field(init=False)   # pushes refused for inf/nan, per worker
    lost: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    # the waiting pulls by Pull.key, in arrival order: a partition's are found in O(workers), not by a walk of all
    pending: dict[tuple[int, int | None], Pull] = field(default_factory=dict)
    failure: str | None = None
    failed_at: float | None = None
    stopping: bool = False
    rejected: int = 0
    impostors: int = 0             # requests naming a worker other than their connection's
    max_ahead: int = 0
    trace: list[list[int]] = field(default_factory=list)   # ssp: [0, worker, steps pushed], [1, worker, step]
    # standalone, modes that go on without a worker: when each worker was last heard from (None until the
    # first worker speaks, so that workers started long after the server are not lost at once)
    last_seen: list[float] | None = None
    changing: bool = False         # the current request has started to change the state
    current: bytes | None = None   # the identity of the request being handled ...
    current_answered: bool = False  # ... and whether it has had its one reply

    def __post_init__(self) -> None:
        self.refused_non_finite = [0] * self.workers
        self.scratch = torch.empty(0, dtype=wire.DTYPES[self.push_dtype])   # sized by `hold`

    # ------------------------------------------------------------------ facts of the config

    @property
    def workers(self) -> int:
        return self.cfg.backend.world_size

    @property
    def mode(self) -> str:
        return self.cfg.backend.mode

    @property
    def barrier(self) -> bool:
        return self.cfg.backend.barrier

    @property
    def timeout_s(self) -> float:
        return self.cfg.backend.timeout_s

    @property
    def silence_s(self) -> float:
        """How long a worker may say nothing: timeout_s, times GEO's k_steps (it speaks once per push)."""
        return self.cfg.backend.timeout_s * self.cfg.backend.push_every

    @property
    def silence_text(self) -> str:
        return "backend.timeout_s" + (" x backend.k_steps" if self.mode == "geo" else "")

    @property
    def watch_silence(self) -> bool:
        """A standalone server has no launcher to say a worker died: where the mode goes on without a worker,
        it loses one that is silent too long."""
        return self.exit_when_done and self.cfg.backend.tolerates_lost_workers

    @property
    def wire_dtype(self) -> str:
        return wire.DTYPE_NAMES[compute_dtype(self.cfg.train.precision)]

    @property
    def push_dtype(self) -> str:
        """The dtype dense pushes travel in: train.compression's cast, else the wire dtype."""
        return wire.DTYPE_NAMES[push_dtype(self.cfg)]

    @property
    def pulls_deltas(self) -> bool:
        """Whether a pushpull's pull is answered with the partition's compressed change (GEO with compression)."""
        return pulls_deltas(self.cfg)

    @property
    def loss_scaling(self) -> bool:
        """Pushes carry a loss scale and an inf/nan verdict only where a server optimizer scales the loss."""
        return self.cfg.train.precision == "fp16" and self.mode != "geo"

    # ------------------------------------------------------------------ facts of the state

    @property
    def live(self) -> set[int]:
        return set(range(self.workers)) - self.lost

    @property
    def initialised(self) -> bool:
        return bool(self.parts)

    @property
    def version(self) -> int:
        """The server's version: the fewest updates any of its partitions has had (0 before init)."""
        return min((p.range.version for p in self.parts), default=0)

    def pushed(self, w: int) -> int:
        """The pushes of worker w that every partition has applied (its next step, once all agree)."""
        return min((p.clock[w] for p in self.parts), default=0)

    def sent_version(self, w: int) -> int:
        """The least version any partition last sent worker w (what a worker names for the whole server)."""
        return min((p.range.sent_version[w] for p in self.parts), default=0)

    def in_round(self, w: int) -> bool:
        """Whether worker w has pushed a partition of the barrier round in progress."""
        return any(w in p.round.pushed for p in self.parts)

    @property
    def span(self) -> str:
        """Its partitions, for messages: "[lo, hi)" of a contiguous range, else the first's and how many."""
        first, last = self.parts[0], self.parts[-1]
        if one_range([(p.lo, p.hi) for p in self.parts]):
            return f"[{first.lo}, {last.hi})"
        return f"{len(self.parts)} partitions dealt round robin, the first [{first.lo}, {first.hi})"

    def params(self) -> torch.Tensor:
        """Its own vector's fp32 parameters, the partitions joined (a new tensor when there are several)."""
        views = [p.range.params.detach() for p in self.parts]
        return views[0] if len(views) == 1 else torch.cat(views)

    def part_at(self, offset: int, op: str) -> Partition:
        """The partition starting at `offset`; PSError naming the partitions this server holds, else."""
        part = self.starts.get(offset)
        if part is not None:
            return part
        starts = [p.lo for p in self.parts]
        shown = ", ".join(map(str, starts[:4])) + (", ..." if len(starts) > 4 else "")
        raise PSError(f"op {op!r}: offset {offset} starts none of this server's {len(starts)} partition(s) of "
                      f"{self.span} (offsets {shown})")

    def booked(self, op: str, offset: Any) -> str:
        """The traffic meter's name for `op` on the partition at `offset`: "replica_<op>" for a replica's
        (replication's bytes, summary.json's `replication`), else `op`."""
        part = self.starts.get(offset) if isinstance(offset, int) else None
        return f"{REPLICA}{op}" if part is not None and part.replica else op

    def sender(self, msg: wire.Message, lost_ok: bool = False) -> int:
        """The worker a request comes from; PSError unless it is one of this run's and (unless `lost_ok`: a
        replica's push, psarch/ps/replication.py) not lost."""
        w = msg.header["worker"]
        if w >= self.workers:
            raise PSError(f"worker {w}: this run has workers 0..{self.workers - 1}")
        if w in self.lost and not lost_ok:
            raise WorkerLost(f"worker {w} was declared lost", self.version)
        return w

    def hold(self, parts: list[tuple[int, int]], params: torch.Tensor, numel: int,
             replicas: frozenset[tuple[int, int]] = frozenset()) -> None:
        """Hold partitions `parts` ([lo, hi) each) of the flat parameter vector of `numel` elements, starting from
        `params`, its held vector (their fp32 values, joined); those in `replicas` are other servers' (chain
        replication)."""
        self.size, self.numel = held(parts), numel
        n, pos, self.parts = self.workers, 0, []
        for a, b in parts:
            self.parts.append(Partition(a, b, RangeState(params[pos:pos + b - a], self.cfg, n), Round(OrderedSum(n)),
                                        [0] * n, (a, b) in replicas))
            pos += b - a
        self.starts = {p.lo: p for p in self.parts}
        self.scratch = torch.empty(max(b - a for a, b in parts), dtype=wire.DTYPES[self.push_dtype])

    def heard(self, worker: Any) -> None:
        """A request from `worker`: its silence starts again (standalone servers that watch silence)."""
        if not self.watch_silence or not isinstance(worker, int) or not 0 <= worker < self.workers:
            return
        now = time.monotonic()
        if self.last_seen is None:
            self.last_seen = [now] * self.workers   # the run has begun: every worker's silence counts from now
        self.last_seen[worker] = now
