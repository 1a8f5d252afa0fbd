"""The servers' stats (psarch/ps/server/stats.py: ServerStats, one per server) as summary.json's entries: traffic,
memory, staleness, lost and dropped workers, refused pushes, each server's detail."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from psarch.ps.theory import SERVER
from psarch.records import LostWorker, Summary

if TYPE_CHECKING:
    from psarch.ps.server.stats import ServerStats


def dropped_workers(stats: list[ServerStats]) -> list[dict[str, Any]]:
    """Each drop of a worker from the rounds, over the servers (each drops a worker on its own clock): the earliest
    round any server dropped it from, whether its process died, and the round every server took it back at (None:
    some did not; psarch/ps/server/readmit.py)."""
    episodes: dict[tuple[int, int], list[Any]] = {}
    for s in stats:
        seen: Counter[int] = Counter()
        for d in s["drops"]:
            episodes.setdefault((d["worker"], seen[d["worker"]]), []).append(d)
            seen[d["worker"]] += 1
    out = []
    for (w, _), ds in sorted(episodes.items()):
        back = [d["readmitted_at"] for d in ds]
        out.append({"worker": w, "from_round": min(d["from_round"] for d in ds), "died": any(d["died"] for d in ds),
                    "readmitted_at": None if None in back or len(ds) < len(stats) else max(back)})
    return out


def summarize(stats: list[ServerStats], lost: list[LostWorker]) -> Summary:
    """The summary.json entries of the servers: traffic, memory, their nodes, staleness, lost workers."""
    hist: Counter[int] = Counter()
    for s in stats:
        hist.update({int(k): v for k, v in s["staleness_histogram"].items()})
    total = sum(hist.values())
    out: Summary = {
        "traffic": {"servers": [{"server": s["server"], "sent": s["sent"], "received": s["received"],
                                 "ops": s["traffic"]["ops"]} for s in stats]},
        "memory": {"servers": [dict(s["memory"], server=s["server"], range=s["range"], held=s["held"]) for s in stats]},
        # each server as a node of the role theory names (psarch.report.nodes: the launcher adds its bytes per step)
        "nodes": {SERVER: [{"index": s["server"], "memory": s["memory"], "sent": s["sent"], "received": s["received"]}
                           for s in stats]},
        "lost_workers": lost,
        "dropped_workers": dropped_workers(stats),
        # a push goes to every server in slices: a worker's count is the most any one server refused
        "refused_pushes": {"non_finite_per_worker": [max(col) for col in zip(*(s["refused_non_finite"]
                                                                                for s in stats))]},
        "servers_detail": [{"server": s["server"], "address": s["address"], "range": s["range"],
                            "partitions": s["partitions"], "version": s["version"], "rejected": s["rejected"],
                            "refused_non_finite": s["refused_non_finite"], "lost": s["lost"], "drops": s["drops"],
                            "dropped_connections": s["dropped_connections"], "applied_pushes": s["applied_pushes"],
                            "repeats": s["repeats"], "skipped_updates": s["skipped_updates"], "failure": s["failure"]}
                           for s in stats],
    }
    if total:
        out["staleness"] = {"histogram": {str(k): v for k, v in sorted(hist.items())},
                            "updates": total, "mean": sum(k * v for k, v in hist.items()) / total,
                            "max": max(hist), "counted": "per update of one partition"}
    if spans := [x for s in stats for x in s.get("timeline", [])]:
        out["timeline"] = spans   # into the run's trace.json (psarch.launch.outputs), not summary.json
    ssp = [s["ssp"] for s in stats if "ssp" in s]
    if ssp:
        out["ssp"] = {"staleness_bound": ssp[0]["staleness_bound"],
                      "max_ahead": max(x["max_ahead"] for x in ssp), "trace": ssp[0]["trace"]}
    return out
