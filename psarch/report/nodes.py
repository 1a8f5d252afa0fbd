"""A run's nodes by role, measured | predicted: summary.json's `nodes` (each role's nodes as measured: the ranks' from
their records, the services' from what they measured) beside `predicted.nodes` (theory's node of each role,
psarch.theory.Prediction.to_dict), under the names the backend's theory gives its roles ("worker", "server",
"stage 0", ...). Every report reads a run's nodes here, and asks which roles train and which serve, never a role's
name. A summary written before either entry is read through the keys it has: the ranks' memory.per_rank and
traffic.per_rank, the one serving role's lists memory.servers and traffic.servers, and its predicted per_rank,
ROLE_memory and traffic_per_step's ROLE_sent and ROLE_received."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, cast

from psarch.records import Summary

Node = dict[str, Any]   # one node: memory (by category, with its total), its bytes and its rank or index
# a summary from before `nodes`: its one serving role's lists (memory, traffic), the key of a node's index in them
# and the role's name where theory's is not known; the ranks' role, as its predicted keys (worker_sent) name it
OLD_LISTS, OLD_INDEX, OLD_SERVING, OLD_TRAINING = "servers", "server", "server", "worker"


@dataclass
class Role:
    """One role of a run: the ranks it stands for (none: its nodes serve the ranks), its nodes as measured (memory
    by category; sent and received over the run and per step) and as theory predicts them (one entry per node:
    per rank, or each of a serving role's nodes; memory, and sent and received per step)."""

    name: str
    ranks: list[int]
    measured: list[Node]
    predicted: list[Node]

    @property
    def serves(self) -> bool:
        """Whether its nodes serve the ranks (a PS's servers) rather than train."""
        return not self.ranks

    def mean(self, figure: str) -> tuple[float | None, float | None]:
        """(measured, predicted) of one of its nodes, the mean over them: "memory" (the total), "sent" or
        "received" (bytes per step; a service's: its run total, set-up included, over the steps); None where none
        was measured or predicted."""
        got = [_measured(n, figure) for n in self.measured]
        want = [_predicted(n, figure) for n in self.predicted]
        return (statistics.fmean(got) if got else None), (statistics.fmean(want) if want else None)

    def total(self, figure: str) -> tuple[float, float]:
        """(measured, predicted) of all its nodes together (see mean)."""
        return (sum(_measured(n, figure) for n in self.measured), sum(_predicted(n, figure) for n in self.predicted))


def _measured(node: Node, figure: str) -> float:
    return float((node["memory"].get("total") if figure == "memory" else node.get(f"{figure}_per_step")) or 0.0)


def _predicted(node: Node, figure: str) -> float:
    return float((node["memory"].get("total") if figure == "memory" else node.get(figure)) or 0.0)


def roles(summary: Summary) -> dict[str, Role]:
    """Every role of the run, in theory's order (then any measured only), measured | predicted."""
    predicted = predicted_nodes(summary)
    measured = summary.get("nodes") or measured_nodes(summary)
    names = list(predicted) + [n for n in measured if n not in predicted]
    return {n: Role(n, predicted[n][0] if n in predicted else [], measured.get(n, []),
                    predicted[n][1] if n in predicted else []) for n in names}


def serving(summary: Summary) -> list[Role]:
    """The roles whose nodes serve the ranks (a PS's servers), with their nodes; [] where there are none."""
    return [r for r in roles(summary).values() if r.serves]


def ranks_mean(summary: Summary, figure: str) -> tuple[float | None, float | None]:
    """(measured, predicted) of one rank, the mean over every rank of every training role (see Role.mean)."""
    trainers = [r for r in roles(summary).values() if not r.serves]
    return Role("ranks", [], [n for r in trainers for n in r.measured], [n for r in trainers for n in r.predicted]
                ).mean(figure)


def predicted_of_rank(summary: Summary, rank: int) -> Node:
    """Theory's node of rank `rank`: its role's."""
    for ranks, predicted in predicted_nodes(summary).values():
        if rank in ranks:
            return predicted[ranks.index(rank)]
    raise ValueError(f"{summary.get('name', 'run')}: theory names no role for rank {rank}")


def system(summary: Summary, figure: str = "memory") -> tuple[float, float]:
    """(measured, predicted) of every node of every role together: the whole system's model states by default."""
    totals = [r.total(figure) for r in roles(summary).values()]
    return sum(m for m, _ in totals), sum(p for _, p in totals)


def predicted_nodes(summary: Summary) -> dict[str, tuple[list[int], list[Node]]]:
    """Each role's ranks and theory's node for each of its nodes: predicted.nodes, else the old keys (the ranks'
    per_rank where told apart, else the fullest's memory and the busiest's link for each; each ROLE_memory's
    role with its link, as many as the run's servers)."""
    s = cast(dict[str, Any], summary)   # the old keys, some of them a role's name
    p = s["predicted"]
    if "nodes" in p:
        return {name: (list(n["ranks"]), [n] * n["count"]) for name, n in p["nodes"].items()}
    ranks = len(s.get("memory", {}).get("per_rank") or []) or s.get("world_size", 1)
    traffic = p.get("traffic_per_step", {})
    alike = {"memory": p.get("memory_per_rank", {}), "sent": traffic.get(f"{OLD_TRAINING}_sent"),
             "received": traffic.get(f"{OLD_TRAINING}_received")}
    out = {OLD_TRAINING: (list(range(ranks)), list(p.get("per_rank") or [alike] * ranks))}
    for key in p:
        if key.endswith("_memory"):
            name = key[:-len("_memory")]
            node = {"memory": {"total": p[key]}, "sent": traffic.get(f"{name}_sent"),
                    "received": traffic.get(f"{name}_received")}
            out[name] = ([], [node] * (s.get(OLD_LISTS) or 0))
    return out


def measured_nodes(summary: Summary) -> dict[str, list[Node]]:
    """Each role's nodes as measured, as the launcher writes summary.json's `nodes`: each rank's memory and traffic
    (memory.per_rank, traffic.per_rank) under the role theory gives its rank, then the services' nodes (those they
    wrote into `nodes`, else a summary's memory.servers and traffic.servers as its serving role's), each with its
    bytes per step (a service's: its run totals, set-up included, over the steps)."""
    predicted = predicted_nodes(summary)
    role_of = {r: name for name, (ranks, _) in predicted.items() for r in ranks}
    first = next((name for name, (ranks, _) in predicted.items() if ranks), OLD_TRAINING)
    out: dict[str, list[Node]] = {name: [] for name, (ranks, _) in predicted.items() if ranks}   # theory's order
    memory, traffic = summary.get("memory", {}).get("per_rank") or [], summary.get("traffic", {}).get("per_rank") or []
    for i in range(max(len(memory), len(traffic))):
        m, t = memory[i] if i < len(memory) else {}, traffic[i] if i < len(traffic) else {}
        rank = m.get("rank", t.get("rank", i))
        node = {"rank": rank, "memory": {k: v for k, v in m.items() if k != "rank"}, "sent": t.get("sent"),
                "received": t.get("received"), "sent_per_step": t.get("sent_per_step"),
                "received_per_step": t.get("received_per_step")}
        out.setdefault(role_of.get(rank, first), []).append(dict(node, modelled=True) if t.get("modelled") else node)
    steps = max(1, summary.get("steps") or 0)
    for name, nodes in (summary.get("nodes") or _old_services(summary, predicted)).items():
        out[name] = [dict(n, sent_per_step=n["sent"] / steps, received_per_step=n["received"] / steps)
                     for n in nodes]
    return out


def _old_services(summary: Summary, predicted: dict[str, tuple[list[int], list[Node]]]) -> dict[str, list[Node]]:
    """A summary from before `nodes`: its servers' lists as the nodes of its serving role."""
    memory = {m.get(OLD_INDEX, i): {k: v for k, v in m.items() if k not in (OLD_INDEX, "range", "held")}
              for i, m in enumerate(summary.get("memory", {}).get(OLD_LISTS) or [])}
    traffic = summary.get("traffic", {}).get(OLD_LISTS) or []
    if not memory and not traffic:
        return {}
    name = next((name for name, (ranks, _) in predicted.items() if not ranks), OLD_SERVING)
    by_index = {t.get(OLD_INDEX, i): t for i, t in enumerate(traffic)}
    indices = list(by_index) or list(memory)
    return {name: [{"index": i, "memory": memory.get(i, {}), "sent": by_index.get(i, {}).get("sent", 0),
                    "received": by_index.get(i, {}).get("received", 0)} for i in indices]}
