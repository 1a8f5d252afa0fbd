"""A prediction's records: what theory says one run's nodes hold and send (memory by category, link bytes per step,
each node's own figures), named by role by the backend's theory (psarch.theory.predict), and the questions the core
asks of them (the fullest rank, the busiest link, a device's memory with the nodes it hosts)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, cast

from psarch.records import Predicted


BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def optimizer_bytes_per_param(optimizer: str, precision: str, momentum: float = 0.0) -> int:
    """K in the ZeRO paper: optimizer state per parameter, fp32 master copy included where kept."""
    state = {"adamw": 8, "adagrad": 4}.get(optimizer, 4 if momentum > 0 else 0)
    return state + (0 if precision == "fp32" else 4)


@dataclass
class MemoryPrediction:
    params: float
    grads: float
    optimizer: float
    buffers: float = 0.0     # model state outside the three categories (a GEO worker's last synced copy)
    frozen: float = 0.0      # parameters that do not train, in the compute dtype

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.buffers + self.frozen

    def to_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "buffers": self.buffers, "frozen": self.frozen, "total": self.total}


@dataclass
class LinkBytes:
    """Bytes one node's link carries per step, each way (mean over steps)."""

    sent: float = 0.0
    received: float = 0.0


@dataclass
class NodePrediction:
    """What theory says of one node of a role (every node of the role alike): the model states it holds, its link
    per step, and the backend's own figures of it, each measured under the same name in summary.json's `extra` (a
    pipeline stage's idle fraction and activations held, a tensor rank's blocks' activation bytes). `ranks`: the
    training ranks the role stands for (none: a node that serves them, as a PS server); `host`: the role whose
    device this node shares, where it has none of its own (a server colocated with a worker); `instances`: how many
    nodes play a role without ranks (a PS's k servers; a role with ranks has one node per rank)."""

    memory: MemoryPrediction
    link: LinkBytes = field(default_factory=LinkBytes)
    figures: dict[str, float] = field(default_factory=dict)
    ranks: Sequence[int] = ()
    host: str | None = None
    instances: int = 1

    @property
    def count(self) -> int:
        """How many nodes play this role: one per rank, else `instances`."""
        return len(self.ranks) or self.instances

    def to_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.to_dict(), "sent": self.link.sent, "received": self.link.received,
                **self.figures}


@dataclass
class Prediction:
    """Everything theory says about one run: each role's node (`nodes`, keyed by the role's name, which the backend
    chooses: "worker", "server", "stage 0", ...; what one node's meters count per step; on a cluster the step
    program says which node carries what), and the step's communication phases and messages. The core asks
    which rank is the fullest and which the busiest, never which role is which."""

    nodes: dict[str, NodePrediction]
    rounds: float                       # communication phases per step: a collective pass, a push or a pull
    messages: float                     # messages in sequence per step, each paying the link latency once

    @classmethod
    def alike(cls, memory: MemoryPrediction, link: LinkBytes, world: int, rounds: float, messages: float,
              role: str = "worker") -> Prediction:
        """A run whose `world` ranks are alike: one role holding `memory` and carrying `link` each."""
        return cls({role: NodePrediction(memory, link, ranks=range(world))}, rounds=rounds, messages=messages)

    @property
    def trainers(self) -> dict[str, NodePrediction]:
        """The roles that train (their nodes are ranks), in the backend's order."""
        return {name: node for name, node in self.nodes.items() if node.ranks}

    @property
    def services(self) -> dict[str, NodePrediction]:
        """The roles that serve the ranks (no rank of their own: a PS's servers)."""
        return {name: node for name, node in self.nodes.items() if not node.ranks}

    @property
    def fullest(self) -> str:
        """The role of the rank whose model states are the most (the first where several are)."""
        return max(self.trainers.items(), key=lambda kv: kv[1].memory.total)[0]

    @property
    def busiest(self) -> str:
        """The role of the rank whose link sends the most a step (the first where several do)."""
        return max(self.trainers.items(), key=lambda kv: kv[1].link.sent)[0]

    @property
    def memory_per_rank(self) -> MemoryPrediction:
        """The model states of the fullest rank (every rank's where ranks are alike)."""
        return self.nodes[self.fullest].memory

    @property
    def link(self) -> LinkBytes:
        """The link of the busiest rank, per step (every rank's where ranks are alike)."""
        return self.nodes[self.busiest].link

    @property
    def rank_by_rank(self) -> bool:
        """Whether the ranks are told apart: they differ (more than one role trains) or carry the backend's own
        figures, which are per rank."""
        trainers = self.trainers
        return len(trainers) > 1 or any(node.figures for node in trainers.values())

    @property
    def per_rank(self) -> list[NodePrediction] | None:
        """Each rank's node in rank order where ranks are told apart (rank_by_rank), else None."""
        if not self.rank_by_rank:
            return None
        of = {r: node for node in self.trainers.values() for r in node.ranks}
        return [of[r] for r in range(len(of))]

    def device_memory(self) -> float:
        """Model states on the fullest device: a rank's with those of the nodes it hosts (a colocated server's)."""
        return max(node.memory.total + sum(s.memory.total for s in self.nodes.values() if s.host == name)
                   for name, node in self.trainers.items())

    def to_dict(self) -> Predicted:
        """The `predicted` entry of summary.json, in the keys readers know: the fullest rank's memory, the busiest
        rank's link as `worker_sent`/`worker_received`, each serving role's link and memory under its own name
        (`server_sent`, `server_received`, `server_memory`), and every rank's where ranks are told apart; and
        `nodes`: each role's node by its name, with the ranks it stands for, how many nodes play it and its host."""
        link = self.link
        traffic = {"worker_sent": link.sent, "worker_received": link.received}
        out: dict[str, Any] = {"memory_per_rank": self.memory_per_rank.to_dict(), "traffic_per_step": traffic,
                               "rounds_per_step": self.rounds, "messages_per_step": self.messages}
        for name, node in self.services.items():
            traffic.update({f"{name}_sent": node.link.sent, f"{name}_received": node.link.received})
            out[f"{name}_memory"] = node.memory.total
        per_rank = self.per_rank
        if per_rank is not None:
            out["per_rank"] = [node.to_dict() for node in per_rank]
        out["nodes"] = {name: {**node.to_dict(), "ranks": list(node.ranks), "count": node.count, "host": node.host}
                        for name, node in self.nodes.items()}
        return cast(Predicted, out)
