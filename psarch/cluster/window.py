"""The steps' window of a run on an emulated cluster: every link's counters read right before the first
step and right after the last, so rendezvous, the initial broadcast and the final export are left out.

Each rank calls `StepMarks.reached()` twice, before its first step and after its last; the launcher's
`StepWindow` thread reads every node's counters once all ranks have reached a mark, while they wait, so
nothing is in flight. A rank knows only that it reached a mark: what is read, and where, is the
launcher's business (the backends never see any of it).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

Counters = dict[str, tuple[int, int]]   # {node namespace: (bytes sent, bytes received)}


class StepMarks:
    """A rank's side (passed to spawned ranks): `reached()` before the first step and after the last."""

    def __init__(self, barrier: Any) -> None:
        self.barrier = barrier

    def reached(self) -> None:
        """Wait until every rank is here and the launcher has read the counters. A broken window (a worker
        lost, the run stopping) lets the rank go on: the steps are never held for a counter."""
        try:
            self.barrier.wait()      # everyone here: the launcher reads now
            self.barrier.wait()      # read: go on
        except threading.BrokenBarrierError:
            pass


class StepWindow:
    """The launcher's side: reads the counters at both marks of `ranks` ranks (a thread of its own)."""

    def __init__(self, mp_context: Any, ranks: int, read: Callable[[], Counters]) -> None:
        self.barrier = mp_context.Barrier(ranks + 1)
        self.marks = StepMarks(self.barrier)
        self.read = read
        self.counts: list[Counters] = []   # at the first mark, then at the second
        self._thread = threading.Thread(target=self._watch, name="psarch-step-window", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            for _ in range(2):
                self.barrier.wait()
                try:
                    self.counts.append(self.read())
                finally:
                    self.barrier.wait()
        except threading.BrokenBarrierError:
            pass

    def steps(self) -> tuple[Counters, Counters] | None:
        """(counters before the first step, after the last), or None where a mark was never reached by all."""
        return (self.counts[0], self.counts[1]) if len(self.counts) == 2 else None

    def abort(self) -> None:
        """Release every rank waiting at a mark (a worker was lost: it will never reach the next one)."""
        self.barrier.abort()

    def close(self) -> None:
        self.abort()
        self._thread.join(10)
