"""The steps' window of a run on an emulated cluster: every link's counters read right before the first
step and right after the last, so rendezvous, the initial broadcast and the final export are left out.

Each rank calls `StepMarks.reached()` twice, before its first step and after its last; the launcher's
`StepWindow` thread reads every node's counters once all ranks have reached a mark, while they wait, so
nothing is in flight. A rank knows only that it reached a mark: what is read, and where, is the
launcher's business (the backends never see any of it).

A rank and the launcher talk over a pipe of their own (a socket pair), not a multiprocessing Barrier: a
Barrier's named semaphores are registered with multiprocessing's resource tracker, which warns of them
as leaked when the launcher is killed with SIGKILL; a pipe is gone with the processes that hold it.
"""
from __future__ import annotations

import threading
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Generic, TypeVar

Counters = TypeVar("Counters")   # what `read` returns: the placement's counters of every node


class StepMarks:
    """One rank's side (passed to its spawned process): `reached()` before the first step and after the last."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def reached(self) -> None:
        """Wait until every rank is here and the launcher has read the counters. A broken window (a worker
        lost, the run stopping: the launcher's end closed) lets the rank go on: the steps are never held
        for a counter."""
        try:
            self.conn.send_bytes(b"r")   # here: the launcher reads once every rank is
            self.conn.recv_bytes()       # read: go on
        except (EOFError, OSError):
            pass


class StepWindow(Generic[Counters]):
    """The launcher's side: reads the counters at both marks of `ranks` ranks (a thread of its own);
    `marks[r]` is rank r's side."""

    def __init__(self, mp_context: Any, ranks: int, read: Callable[[], Counters]) -> None:
        pipes = [mp_context.Pipe() for _ in range(ranks)]
        self._ends: list[Connection] = [mine for mine, _ in pipes]
        self.marks = [StepMarks(theirs) for _, theirs in pipes]
        self._stop_r, self._stop_w = mp_context.Pipe(duplex=False)
        self.read = read
        self.counts: list[Counters] = []   # at the first mark, then at the second
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="psarch-step-window", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        for _ in range(2):
            waiting = list(self._ends)
            while waiting:
                ready = wait(waiting + [self._stop_r])
                if self._stop_r in ready:
                    return
                for conn in [c for c in waiting if c in ready]:
                    try:
                        conn.recv_bytes()
                    except (EOFError, OSError):
                        return
                    waiting.remove(conn)
            try:
                self.counts.append(self.read())
            finally:
                for conn in self._ends:
                    conn.send_bytes(b"g")

    def steps(self) -> tuple[Counters, Counters] | None:
        """(counters before the first step, after the last), or None where a mark was never reached by all."""
        return (self.counts[0], self.counts[1]) if len(self.counts) == 2 else None

    def abort(self) -> None:
        """Release every rank waiting at a mark, and any that reaches one later (a worker was lost: it will
        never reach the next one): the watch stops and the launcher's ends close."""
        if self._closed:
            return
        self._closed = True
        self._stop_w.send_bytes(b"x")
        self._thread.join(10)
        for conn in self._ends:
            conn.close()

    def close(self) -> None:
        self.abort()
