"""A rank's timeline: spans (compute, each communication call) recorded on the process's clock during the steps
train.trace_steps names. One recorder per process (RECORDER): a communicator or a worker's link times a call
only while it is on (one attribute read otherwise), so tracing costs nothing in steps not traced. The runner
turns it on around a traced step and takes its spans; psarch.report.trace writes them as a Chrome trace."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, TypedDict


class SpanFields(TypedDict):
    """A span as JSON (Span.to_dict): what a rank's record and a server's stats carry to the launcher."""

    node: str
    lane: str
    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Span:
    """`name` on lane `lane` of node `node`, from `start` to `end` seconds (any common origin)."""

    node: str
    lane: str
    name: str
    start: float
    end: float

    def to_dict(self) -> SpanFields:
        return {"node": self.node, "lane": self.lane, "name": self.name, "start": self.start, "end": self.end}

    @staticmethod
    def of(d: SpanFields) -> Span:
        return Span(d["node"], d["lane"], d["name"], d["start"], d["end"])


class Recorder:
    """Spans (lane, name, start, end; time.perf_counter seconds) of this process, kept only while `on`. Safe
    from a communicator's thread."""

    def __init__(self) -> None:
        self.on = False
        self._spans: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()

    def add(self, lane: str, name: str, start: float, end: float) -> None:
        if self.on:
            with self._lock:
                self._spans.append((lane, name, start, end))

    @contextmanager
    def span(self, lane: str, name: str) -> Iterator[None]:
        """Time the block as one span (when on)."""
        if not self.on:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, name, t0, time.perf_counter())

    def take(self, node: str) -> list[Span]:
        """The spans recorded since the last take, as node `node`'s, on the wall clock (seconds since the epoch:
        ranks on other hosts align as well as their clocks do); the recorder is left empty."""
        offset = time.time() - time.perf_counter()
        with self._lock:
            got, self._spans = self._spans, []
        return [Span(node, lane, name, a + offset, b + offset) for lane, name, a, b in got]


RECORDER = Recorder()


def traced_steps(steps: int, trace_steps: list[int]) -> set[int]:
    """The steps of a run of `steps` that train.trace_steps names (negative: counted from the end, -1 the last)."""
    return {x % steps for x in trace_steps}
