"""A training step as a program: compute spans and transfers between nodes, each waiting for named ops, and the
cluster it runs on. Each backend's theory writes its own (collective/program.py, zero/program.py,
psarch/ps/program.py) from the facts its trainer acts on; psarch.theory.simulate plays any of them.

A program may be written in full (every rank its nodes and ops) or reduced, for steps in which every rank acts
alike: a Node then stands for `count` alike nodes and a Transfer for `copies` alike transfers made at once, so
each of the nodes' links carries copies / count of them (a ring step: N copies over N workers, one on each
link; a push of each worker to each of k servers: N·k copies, k on a worker's uplink, N on a server's
downlink). The simulator treats both the same way; a test plays each backend's program both ways.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Union


@dataclass(frozen=True)
class Node:
    """One machine's network interface (payload bytes/s each way); `count`: the alike nodes it stands for."""

    up: float
    down: float
    count: int = 1


@dataclass(frozen=True)
class Cluster:
    """The nodes a program runs on, and the latency α every message pays before its bytes move."""

    nodes: tuple[Node, ...]
    alpha_s: float = 0.0

    @staticmethod
    def of(program: Program, rate: float, alpha_s: float = 0.0, server_rate: float | None = None) -> Cluster:
        """The nodes `program` declares, each link `rate` bytes/s each way, a node of servers alone
        `server_rate` (None: `rate`)."""
        return Cluster(tuple(Node(r, r, count) for role, count in program.nodes
                             for r in [server_rate if role == SERVER and server_rate is not None else rate]),
                       alpha_s)


@dataclass(frozen=True)
class Compute:
    """`seconds` of a node's device, started once every op named in `after` is done."""

    name: str
    node: int
    seconds: float
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class Transfer:
    """`bytes` from node `src`'s uplink to node `dst`'s downlink, once every op in `after` is done, on
    connection `conn` (one transfer at a time per connection, in the order they become ready). It pays α per
    message first (`messages` > 1: a chain of messages back to back on the connection, as a ring pass's steps in
    a reduced program); `copies`: the alike transfers it stands for in a reduced program."""

    name: str
    src: int
    dst: int
    bytes: float
    conn: Hashable
    after: tuple[str, ...] = ()
    messages: int = 1
    copies: int = 1


Op = Union[Compute, Transfer]


WORKER, SERVER, BOTH = "worker", "server", "worker+server"   # what runs on a node


@dataclass
class Program:
    """A step's ops in the order they were written (ties between ops ready at once go in this order), and its
    nodes: what runs on each (WORKER, SERVER, BOTH) and how many alike nodes it stands for; `steps`: the training
    steps one play of it stands for (GEO's k local steps and their one exchange), by which its time is divided."""

    ops: list[Op] = field(default_factory=list)
    nodes: list[tuple[str, int]] = field(default_factory=list)
    steps: int = 1

    def node(self, role: str, count: int = 1) -> int:
        """Declare the next node; its index."""
        self.nodes.append((role, count))
        return len(self.nodes) - 1

    def compute(self, name: str, node: int, seconds: float, after: tuple[str, ...] = ()) -> str:
        self.ops.append(Compute(name, node, seconds, after))
        return name

    def transfer(self, name: str, src: int, dst: int, nbytes: float, conn: Hashable, after: tuple[str, ...] = (),
                 messages: int = 1, copies: int = 1) -> str:
        self.ops.append(Transfer(name, src, dst, nbytes, conn, after, messages, copies))
        return name

    def join(self, name: str, node: int, after: tuple[str, ...]) -> str:
        """A point that is reached once every op in `after` is done (a zero-second span)."""
        return self.compute(name, node, 0.0, after)


@dataclass(frozen=True)
class DataStep:
    """What a data-parallel rank computes in a step, in seconds: forward, backward, the optimizer step; and the
    device's rates, which price the compute a program adds to these (a gradient compression's): FLOP/s (peak x mfu)
    and memory bytes/s, 0 where the device is not modelled (that compute is then left out)."""

    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0
    flops_per_s: float = 0.0
    memory_bytes_per_s: float = 0.0

    def seconds(self, flops: float, nbytes: float) -> float:
        """The time of `flops` at the device's FLOP rate plus `nbytes` moved at its memory bandwidth."""
        return (flops / self.flops_per_s if self.flops_per_s else 0.0) + \
            (nbytes / self.memory_bytes_per_s if self.memory_bytes_per_s else 0.0)

    @staticmethod
    def of(compute_s: float, backward_s: float | None = None) -> DataStep:
        """A step of `compute_s` of which `backward_s` is backward (unknown: 2/3, backward's twice forward's FLOPs)."""
        back = 2 / 3 * compute_s if backward_s is None else backward_s
        return DataStep(max(0.0, compute_s - back), back)


def backward_spans(p: Program, rank: int, node: int, step: DataStep, points: list[float],
                   after: tuple[str, ...] = (), extra_s: list[float] | None = None) -> tuple[list[str], str]:
    """Forward, then backward cut at `points` (fractions of backward, each clamped to [0, 1]): the names of the
    ops that end at each point, in the order of `points`, and the name of the op that ends backward. extra_s:
    seconds computed at each point (a hook's work on the bucket ready there), delaying the rest of backward."""
    clamp = [min(1.0, max(0.0, x)) for x in points]
    extra: dict[float, float] = {}
    for x, s in zip(clamp, extra_s or []):
        extra[x] = extra.get(x, 0.0) + s
    prev = p.compute(f"fwd{rank}", node, step.forward_s, after)
    named, at = {}, 0.0
    for i, x in enumerate(sorted(set(clamp) | {1.0})):
        prev = p.compute(f"bwd{rank}.{i}", node, step.backward_s * (x - at), (prev,))
        if extra.get(x):
            prev = p.compute(f"hook{rank}.{i}", node, extra[x], (prev,))
        named[x], at = prev, x
    return [named[x] for x in clamp], prev


def chunks(total: float, cap: float) -> list[float]:
    """`total` bytes in pieces of `cap` (the last one shorter; cap <= 0 or >= total: one piece), in order."""
    if cap <= 0 or cap >= total:
        return [total]
    whole = int(total // cap)
    rest = total - whole * cap
    return [cap] * whole + ([rest] if rest > 1e-9 * total else [])


def ready_points(sizes: list[float]) -> list[float]:
    """Where in backward (a fraction) each of `sizes` is ready, backward producing bytes at an even rate and the
    pieces in this order: the first after its own share, the last at the end."""
    total, at, out = sum(sizes) or 1.0, 0.0, []
    for s in sizes:
        at += s
        out.append(at / total)
    return out
