"""The pulls a server holds until its mode lets a worker have the parameters.

When a pull is answered, per mode (each partition on its own: a pull names its partition by offset):
- sync, geo with barrier: once the partition's round `step` is complete, i.e. every live worker pushed it;
- ssp: once the slowest live worker has pushed at least `step - staleness_bound` steps of the partition;
- async, geo: at once.
GEO with train.compression answers a pushpull's pull with the partition's compressed change since what the worker
holds (deltas.py), a whole pull (start-up) with the parameters.
A worker waits for one pull per partition at a time, so the queue holds at most one such pull per worker and
partition, filed by the two (state.py's Pull.key): a push finds its partition's waiting pulls without a walk of
every partition's.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from psarch.ps import wire
from psarch.ps.errors import PSError
from psarch.ps.partitions import replicas
from psarch.ps.replication import members_text
from psarch.ps.server.deltas import NonFiniteDelta
from psarch.ps.server.replies import Replies
from psarch.ps.server.state import TRACE_LIMIT, AckFields, Partition, Pull, ServerState


class PullQueue:
    """Waiting pulls (`state.pending`): queued by `pull` and `pushpull`, answered by `serve` when `ready`."""

    def __init__(self, state: ServerState, replies: Replies) -> None:
        self.state, self.replies = state, replies

    def on_pull(self, ident: bytes, msg: wire.Message) -> None:
        s = self.state
        w, step = s.sender(msg), msg.header["step"]
        if msg.header["want"] != s.wire_dtype:
            raise PSError(f"pull: dtype {msg.header['want']!r:.40}, this run's wire dtype is {s.wire_dtype}")
        # without an offset: the first partition (the whole range when there is one); before init, it waits
        part = s.part_at(msg.header.get("offset", s.parts[0].lo), "pull") if s.initialised else None
        pushed = part.clock[w] if part is not None else 0
        # a pull beyond the worker's next step could only wait until the timeout and fail the run
        if step > pushed:
            raise PSError(f"pull: worker {w} asked for step {step}, but has pushed {pushed} step(s): "
                          f"its next step is {pushed}")
        self.check_one(w, "pull", part)
        if part is not None and part.range.copies is not None and not part.range.copies.takes_whole():
            raise PSError(f"pull: worker {w} asks for partition [{part.lo}, {part.hi}) whole, but every worker "
                          f"holds it as moved by compressed deltas since start-up (GEO with the barrier): a whole "
                          f"pull now would hide what those deltas left out; pull deltas")
        s.changing = True
        self.wait(ident, "pull", w, step, {}, part)
        self.serve(part)

    def check_one(self, w: int, op: str, part: Partition | None) -> None:
        """A worker waits for one pull of a partition at a time: the queue holds at most one per worker and partition."""
        p = self.state.pending.get((w, part.lo if part is not None else None))
        if p is not None:
            raise PSError(f"{op}: worker {w} already has a pull waiting (for step {p.step}); "
                          f"a worker waits for one pull of a partition at a time")

    def wait(self, ident: bytes, op: str, worker: int, step: int, extra: AckFields,
             part: Partition | None) -> None:
        """Queue `worker`'s pull of `part` for `step` (answered by the next `serve` that finds it ready)."""
        pull = Pull(ident, op, worker, step, time.monotonic(), extra, part)
        self.state.pending[pull.key] = pull

    def params(self, part: Partition) -> torch.Tensor:
        """Partition `part`'s parameters as a pull's reply carries them, in the wire dtype. Zero-copy: in the barrier
        modes the parameters cannot change before every worker has pushed again, i.e. received this reply.
        Elsewhere another push may land at once: a copy."""
        s, data = self.state, part.range.params.detach()
        want = wire.DTYPES[s.wire_dtype]
        return data.to(want) if data.dtype != want else data if s.barrier else data.clone()

    def ready(self, p: Pull) -> bool:
        s = self.state
        if p.part is None:   # asked before init: the first partition, once there is one (then filed under it)
            if not s.initialised:
                return False
            del s.pending[p.key]
            p.part = s.parts[0]
            s.pending[p.key] = p
        if s.barrier:
            return p.part.range.version >= p.step
        if s.mode == "ssp":
            return p.step - p.part.slowest(s.live) <= s.cfg.backend.staleness_bound
        return True

    def serve(self, part: Partition | None = None) -> None:
        """Answer every waiting pull (of `part`, when given: nothing else can have become ready) the mode now allows."""
        s = self.state
        waiting = (list(s.pending.values()) if part is None else
                   [p for p in (s.pending.get((w, part.lo)) for w in range(s.workers)) if p is not None])
        for p in waiting:
            if not self.ready(p):
                continue
            placed = p.part
            assert placed is not None   # ready() placed it on a partition
            st, w, step = placed.range, p.worker, p.step
            header: dict[str, Any] = dict(p.extra, op="params", version=st.version, offset=placed.lo, scale=st.scale)
            if s.mode == "ssp":
                ahead = max(0, step - placed.slowest(s.live))
                s.max_ahead = max(s.max_ahead, ahead)
                header["ahead"] = ahead
                if len(s.trace) < TRACE_LIMIT:
                    s.trace.append([1, w, step])
            if s.mode == "sync" and st.version:
                header["skipped"] = placed.round.last_skipped or header.get("skipped", False)
                if replicas(s.cfg):   # the workers its round summed: its followers sum the same (replication.py)
                    header["summed"] = members_text(placed.round.last_members)
            keys = None
            if p.op in wire.DELTA_PULLS:   # GEO with compression: the change since what the worker holds
                assert st.copies is not None   # (pushes.py accepts these ops only then)
                try:
                    keys, data = st.copies.delta(w, st.params, st.version)
                except NonFiniteDelta as e:
                    return self.replies.fail(f"geo pull of worker {w}, partition [{placed.lo}, {placed.hi}): {e}")
                header["op"] = wire.REPLY_TO[p.op]
            else:
                data = self.params(placed)
                if st.copies is not None:   # a whole pull (start-up): the worker holds exactly this now
                    st.copies.whole(w, data)
            st.remember_sent(w)
            del s.pending[p.key]   # before the reply: an error past this point must not answer it again
            self.replies.send(p.ident, s.booked(p.op, placed.lo), header, data, keys)
            if s.last_seen is not None:  # it waited on us until now: its silence starts here
                s.last_seen[w] = time.monotonic()
