"""What a parameter server and its launcher say to each other over the launcher's pipe: the launcher's commands,
and what a server sends back (psarch/ps/services.py): the figures it measured, for summary.json (`server_stats`),
and its final parameters, for model.pt (`final_params`)."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import torch

from psarch.cluster.device import dilation
from psarch.meters import peak_memory
from psarch.records import TrafficFigures
from psarch.timeline import Span, SpanFields

if TYPE_CHECKING:
    from psarch.ps.server.parameter_server import ParameterServer


class Command(TypedDict):
    """A command on the launcher's pipe (psarch/ps/services.py): `lost` names the worker whose process died."""

    cmd: str                     # "lost", "stats" or "stop"
    worker: NotRequired[int]


class SSPStats(TypedDict):
    """What an ssp server measured of its bound."""

    staleness_bound: int
    max_ahead: int
    trace: list[list[int]]       # ServerState.trace


class ServerStats(TypedDict):
    """What one server measured (server_stats), sent to the launcher for summary.json (psarch.ps.servers_summary)."""

    server: int
    address: str
    range: list[int]             # [lo, hi) of the flat vector
    held: int
    partitions: int
    version: int
    sent: int
    received: int
    traffic: TrafficFigures
    memory: dict[str, Any]       # bytes by category, the peak and its kind; with rows, theirs (ServerRows.add_memory)
    rejected: int
    refused_non_finite: list[int]   # per worker
    lost: list[int]
    drops: list[Any]             # readmit.Drop: each worker dropped from the rounds, from which round, re-admitted at
    dropped_connections: dict[str, int]
    applied_pushes: int          # pushes applied (each partition's its own), and repeats answered without applying
    repeats: int
    failure: str | None
    skipped_updates: int
    staleness_histogram: dict[str, int]
    ssp: NotRequired[SSPStats]
    timeline: NotRequired[list[SpanFields]]   # train.trace_steps' rounds (psarch.timeline.Span.to_dict)


def server_stats(server: ParameterServer) -> ServerStats:
    """What `server` measured: traffic, memory, staleness, rejected requests, lost workers."""
    s = server.state
    traffic = server.meter.report().to_dict()
    peak, kind = peak_memory(torch.device("cpu"))
    memory: Counter[str] = Counter({"total": 0})
    staleness: Counter[int] = Counter()
    for part in s.parts:
        memory.update(part.range.memory())
        staleness.update(part.range.staleness)
    out: ServerStats = {
        "server": s.index, "address": server.address, "range": [s.parts[0].lo, s.parts[-1].hi] if s.parts else [0, 0],
        "held": s.size, "partitions": len(s.parts),
        "version": s.version, "sent": traffic["sent"], "received": traffic["received"],
        "traffic": traffic, "memory": dict(memory, peak=peak, peak_kind=kind,
                                           early_pushes_peak=sum(p.round.sum.peak for p in s.parts)),
        "rejected": s.rejected, "refused_non_finite": s.refused_non_finite, "lost": sorted(s.lost),
        "drops": server.readmit.drops,
        "dropped_connections": dict(server.connections.dropped),
        "applied_pushes": server.pushes.applied, "repeats": server.repeats.repeats,
        # every partition skips a skipped step: the most any partition skipped is the steps skipped
        "failure": s.failure, "skipped_updates": max((p.range.skipped for p in s.parts), default=0),
        "staleness_histogram": {str(k): v for k, v in sorted(staleness.items())},
    }
    if server.timeline.on:
        out["timeline"] = _rounds(server)
    if s.mode == "ssp":
        out["ssp"] = {"staleness_bound": s.cfg.backend.staleness_bound, "max_ahead": s.max_ahead,
                      "trace": s.trace}
    if server.rows is not None:
        server.rows.add_memory(out["memory"])
    return out


def final_params(server: ParameterServer) -> bytes | memoryview:
    """The launcher's model.pt: the server's held vector (its own and its replicas' partitions, joined), then its
    rows (psarch/ps/rows.py's join_parts splits them)."""
    if not server.state.initialised:
        return b""
    dense = server.state.params()
    final = dense if server.rows is None else server.rows.final(dense)
    return final.numpy().data.cast("B")


def _rounds(server: ParameterServer) -> list[SpanFields]:
    """The traced rounds' spans in the cluster's time, as the workers' (psarch.launch.runner); none where D was not
    resolved for the servers (torchrun's rank 0 starts them with the config as asked)."""
    try:
        d = dilation(server.state.cfg)
    except RuntimeError:
        return []
    return [Span(x.node, x.lane, x.name, x.start / d, x.end / d).to_dict()
            for x in server.timeline.take(f"server {server.state.index}")]
