"""Timelines in the Chrome trace format (the JSON that Perfetto and chrome://tracing open): one complete event
("ph": "X") per span, ts and dur in microseconds, pid a node (a rank, a server), tid a lane on it (compute, a
connection); the nodes' and lanes' names as metadata events. A run's measured steps (psarch.timeline) and the
simulator's predicted step (psarch.theory.simulate.spans) are both written here, so the two open side by side."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from psarch.timeline import Span


def trace_events(spans: Iterable[Span], origin: float | None = None) -> dict[str, Any]:
    """The trace of `spans` as the format's JSON object, times from `origin` (None: the earliest start). Nodes
    and lanes are numbered in order of first appearance, so the file lists them as the spans do."""
    spans = list(spans)
    for s in spans:
        if not s.end >= s.start:   # also refuses NaN
            raise ValueError(f"trace: span {s.name!r} on {s.node}/{s.lane} ends ({s.end}) before it starts ({s.start})")
    t0 = min((s.start for s in spans), default=0.0) if origin is None else origin
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    events: list[dict[str, Any]] = []
    for s in spans:
        pid = pids.setdefault(s.node, len(pids))
        tid = tids.setdefault((s.node, s.lane), len(tids))
        events.append({"name": s.name, "ph": "X", "pid": pid, "tid": tid,
                       "ts": round((s.start - t0) * 1e6, 3), "dur": round((s.end - s.start) * 1e6, 3)})
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": node}} for node, pid in pids.items()]
    meta += [{"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
             for pid in pids.values()]
    meta += [{"name": "thread_name", "ph": "M", "pid": pids[node], "tid": tid, "args": {"name": lane}}
             for (node, lane), tid in tids.items()]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, spans: Iterable[Span], origin: float | None = None) -> Path:
    """Write `spans` as a Chrome trace file at `path`; the path."""
    path = Path(path)
    path.write_text(json.dumps(trace_events(spans, origin)) + "\n")
    return path


def read_trace(path: str | Path) -> list[Span]:
    """The spans of a Chrome trace file (its complete events, with their nodes' and lanes' names), seconds from
    the trace's origin: what the renderer draws."""
    try:
        events = json.loads(Path(path).read_text())["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a Chrome trace file ({e})") from None
    nodes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    return [Span(nodes.get(e["pid"], str(e["pid"])), lanes.get((e["pid"], e["tid"]), str(e["tid"])), e["name"],
                 e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events if e.get("ph") == "X"]
