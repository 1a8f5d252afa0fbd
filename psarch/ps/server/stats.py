"""What a parameter server and its launcher say to each other over the launcher's pipe: the launcher's commands,
and the figures a server sends back for summary.json (psarch/ps/services.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from psarch.records import TrafficFigures

if TYPE_CHECKING:
    from psarch.timeline import SpanFields


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
    """What one server measured (ParameterServer.stats), sent to the launcher for summary.json (psarch.ps.servers_summary)."""

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
    failure: str | None
    skipped_updates: int
    staleness_histogram: dict[str, int]
    ssp: NotRequired[SSPStats]
    timeline: NotRequired[list[SpanFields]]   # train.trace_steps' rounds (psarch.timeline.Span.to_dict)
