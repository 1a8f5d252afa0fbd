"""The pulls a server holds until its mode lets a worker have the parameters (mixed into ParameterServer).

When a pull is answered, per mode:
- sync, geo with barrier: once round `step` is complete, i.e. every live worker pushed it;
- ssp: once the slowest live worker has pushed at least `step - staleness_bound` steps;
- async, geo: at once.
A worker waits for one pull at a time, so the queue holds at most one pull per worker.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from psarch.ps import wire
from psarch.ps.errors import PSError

TRACE_LIMIT = 100_000


@dataclass
class _Pull:
    """A pull waiting until the mode lets `worker` have the parameters for `step`."""

    ident: bytes
    op: str
    worker: int
    step: int
    since: float
    extra: dict[str, Any]       # pushpull: what the push's ack would have said


class PullQueue:
    """Waiting pulls: queued by `pull`/`pushpull`, answered by `_serve_pending` when `_ready`."""

    def _on_pull(self, ident: bytes, msg: wire.Message) -> None:
        w, step = self._worker(msg), msg.header["step"]
        if msg.header["want"] != self.wire_dtype:
            raise PSError(f"pull: dtype {msg.header['want']!r:.40}, this run's wire dtype is {self.wire_dtype}")
        # a pull beyond the worker's next step could only wait until the timeout and fail the run
        if step > self.clock[w]:
            raise PSError(f"pull: worker {w} asked for step {step}, but has pushed {self.clock[w]} step(s): "
                          f"its next step is {self.clock[w]}")
        self._check_one_pull(w, "pull")
        self.changing = True
        self.pending.append(_Pull(ident, "pull", msg.header["worker"], msg.header["step"], time.monotonic(), {}))
        self._serve_pending()

    def _check_one_pull(self, w: int, op: str) -> None:
        """A worker waits for one pull at a time: the waiting queue holds at most one pull per worker."""
        for p in self.pending:
            if p.worker == w:
                raise PSError(f"{op}: worker {w} already has a pull waiting (for step {p.step}); "
                              f"a worker waits for one pull at a time")

    # ------------------------------------------------------------------ pulls and time

    def _live(self) -> set[int]:
        return set(range(self.workers)) - self.lost

    def _slowest(self) -> int:
        live = self._live()
        return min((self.clock[w] for w in live), default=0)

    def _ready(self, p: _Pull) -> bool:
        if self.state is None:
            return False
        if self.barrier:
            return self.state.version >= p.step
        if self.mode == "ssp":
            return p.step - self._slowest() <= self.cfg.backend.staleness_bound
        return True

    def _serve_pending(self) -> None:
        for p in list(self.pending):
            if not self._ready(p):
                continue
            st, w, step = self.state, p.worker, p.step
            header: dict[str, Any] = dict(p.extra, op="params", version=st.version, offset=self.lo, scale=st.scale)
            if self.mode == "ssp":
                ahead = max(0, step - self._slowest())
                self.max_ahead = max(self.max_ahead, ahead)
                header["ahead"] = ahead
                if len(self.trace) < TRACE_LIMIT:
                    self.trace.append([1, w, step])
            if self.mode == "sync" and st.version:
                header["skipped"] = self.last_skipped or header.get("skipped", False)
            data = st.params.detach()
            # Zero-copy send: in the barrier modes the parameters cannot change before every worker has
            # pushed again, i.e. received this reply. Elsewhere another push may land at once: send a copy.
            data = data.to(self.scratch.dtype) if data.dtype != self.scratch.dtype else (
                data if self.barrier else data.clone())
            st.remember_sent(w)
            self.pending.remove(p)   # before the reply: an error past this point must not answer it again
            self._send(p.ident, p.op, header, data)
            if self.last_seen is not None:  # it waited on us until now: its silence starts here
                self.last_seen[w] = time.monotonic()
