"""A server's pushes and its range: `init`, `push`, `pushpull`, `fetch`, and the end of a barrier round.

The server, not the worker, is the authority on what a worker may send: a push must be that worker's next
step and name the version this server last sent it (staleness is computed from the server's own record). In
fp16 a push carries the loss scale it was computed with (a power of two >= the scaler's minimum, in sync
exactly the server's) and its inf/nan verdict. Every push, in every mode and precision, is checked for inf/nan
frame by frame as it is decoded, before it touches the parameters: one that holds any (outside fp16's declared
overflow steps) is refused with code "non_finite" and counted for its worker, and the worker stops the run.
A finite push whose update would still be non-finite (updates.py) is refused the same way; a barrier round whose
update would be is not applied, and fails the server. A barrier round's sum is added in worker order (rounds.py),
so its bits do not depend on timing.

Partitions (state.py): a push names its partition by its offset and carries that partition's elements; every
check, round and update above is the partition's own, so a partition's round completes, is checked, is applied
and answers its pulls as soon as every live worker has pushed it, while the next partitions are still arriving.
A round's rows go with the first of its partitions to complete; a partition whose round would not be finite
fails the server, which stops the run with the partitions completed before it applied.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from psarch.ps import wire
from psarch.ps.errors import NonFinitePush, PSError, WorkerLost
from psarch.ps.layout import held, server_partitions
from psarch.ps.server.pulls import PullQueue
from psarch.ps.server.replies import Replies
from psarch.ps.server.rounds import Pairs
from psarch.ps.server.state import TRACE_LIMIT, AckFields, Partition, ServerState
from psarch.ps.server.updates import NonFiniteUpdate, RangeState
from psarch.theory import topk_k
from psarch.timeline import Recorder, traced_steps

if TYPE_CHECKING:
    from psarch.ps.server.rows import ServerRows


def check_range(msg: wire.Message, dtype: str, lo: int, hi: int) -> None:
    """PSError unless the message's tensor is range [lo, hi) of the flat vector (one partition), in `dtype`."""
    h = msg.header
    if h["offset"] != lo or msg.shape != (hi - lo,):
        raise PSError(f"op {msg.op!r}: range offset {h['offset']} shape {h.get('shape')}, the partition there is "
                      f"[{lo}, {hi}) (offset {lo}, shape [{hi - lo}])")
    if h["dtype"] != dtype:
        raise PSError(f"op {msg.op!r}: dtype {h['dtype']}, this run's wire dtype is {dtype}")


def check_pairs(msg: wire.Message, dtype: str, lo: int, hi: int, ratio: float) -> torch.Tensor:
    """The keys of a sparse push of partition [lo, hi) (top-k): PSError unless it carries exactly top-k's k
    distinct indices within the partition, and k values in `dtype`."""
    h, k = msg.header, topk_k(hi - lo, ratio)
    if h["offset"] != lo or msg.shape != (k, 1):
        raise PSError(f"op {msg.op!r}: offset {h['offset']} values {h.get('shape')}, the partition there is "
                      f"[{lo}, {hi}) and takes its top-k's {k} pairs (offset {lo}, values [{k}, 1])")
    if h["dtype"] != dtype:
        raise PSError(f"op {msg.op!r}: dtype {h['dtype']}, this run's wire dtype is {dtype}")
    keys = msg.keys()
    if k and (int(keys.min()) < 0 or int(keys.max()) >= hi - lo or keys.unique().numel() != k):
        raise PSError(f"op {msg.op!r}: its keys must be {k} distinct indices in [0, {hi - lo})")
    return keys


class Pushes:
    """Applies pushes to the server's range (and, through `rows`, ends a round of embedding rows too)."""

    def __init__(self, state: ServerState, replies: Replies, pulls: PullQueue, rows: ServerRows | None,
                 timeline: Recorder | None = None) -> None:
        self.state, self.replies, self.pulls, self.rows = state, replies, pulls, rows
        # train.trace_steps: each barrier round of a traced step, from its first push to its update applied
        self.timeline = timeline
        self.traced = traced_steps(state.cfg.train.steps, state.cfg.train.trace_steps)
        self.applied = 0   # pushes applied, a partition's each (a repeat is not: repeats.py)

    def on_init(self, ident: bytes, msg: wire.Message) -> None:
        """A server started without parameters (benchmarks, tests) takes them from one `init`."""
        s = self.state
        s.sender(msg)
        if s.initialised:
            raise PSError("init: the parameters are already initialised")
        try:
            parts = server_partitions(s.cfg, msg.header["numel"])[s.index]
        except ValueError as e:
            raise PSError(f"init: {e}") from None
        lo, size = parts[0][0], held(parts)
        if msg.header["offset"] != lo or msg.shape != (size,):
            raise PSError(f"op 'init': offset {msg.header['offset']} shape {msg.header.get('shape')}, this server "
                          f"holds {len(parts)} partition(s), {size} elements from offset {lo} (offset {lo}, shape "
                          f"[{size}])")
        if msg.header["dtype"] != "float32":
            raise PSError(f"op 'init': dtype {msg.header['dtype']}, parameters start in float32")
        s.changing = True
        s.hold(parts, msg.tensor(), msg.header["numel"])
        self.replies.send(ident, "init", {"op": "ack", "version": 0})
        self.pulls.serve()

    def on_push(self, ident: bytes, msg: wire.Message) -> None:
        part = self._part(msg)
        reply = self.apply(msg, part)
        self.replies.send(ident, "push", dict(reply, op="ack", version=part.range.version))
        self.complete_round(part)
        self.pulls.serve(part)

    def on_pushpull(self, ident: bytes, msg: wire.Message) -> None:
        """A push, then a pull for the next step, answered by one `params` reply (half the messages)."""
        part = self._part(msg)
        self.pulls.check_one(self.state.sender(msg, lost_ok=part.follows), "pushpull", part)
        extra = self.apply(msg, part)
        # GEO with compression: answered with the partition's compressed change (pulls.py, deltas.py)
        op = msg.op if msg.op in wire.DELTA_PULLS else "pushpull"
        self.pulls.wait(ident, op, msg.header["worker"], msg.header["step"] + 1, extra, part)
        self.complete_round(part)
        self.pulls.serve(part)

    def on_fetch(self, ident: bytes, msg: wire.Message) -> None:
        s = self.state
        s.sender(msg)
        if not s.initialised:
            raise PSError("fetch before init: no parameters yet")
        self.replies.send(ident, "fetch", {"op": "params", "version": s.version, "offset": s.parts[0].lo},
                          s.params().clone())

    def _part(self, msg: wire.Message) -> Partition:
        """The partition a push names by its offset (PSError before init or for an offset starting none)."""
        if not self.state.initialised:
            raise PSError(f"{msg.op} before init: no parameters yet")
        return self.state.part_at(msg.header["offset"], msg.op)

    def apply(self, msg: wire.Message, part: Partition) -> AckFields:
        """Validate a push of `part` (raise PSError, changing nothing) and apply it; returns the ack's fields."""
        s, h = self.state, msg.header
        w, data, found_inf = self._checked(msg, part)
        # every check passed: from here on the message is applied
        s.changing = True
        st, rnd = part.range, part.round
        staleness = st.version - st.sent_version[w]
        skipped = None
        if s.barrier:
            if part.follows:   # summed once its first holder says with which others (replication.py)
                rnd.sum.keep(w, data)
            else:
                rnd.sum.add(w, data, st.acc, s.live, rnd.pushed)
            if found_inf:
                rnd.infs.add(w)
            if not rnd.pushed:
                rnd.since = time.monotonic()
            rnd.pushed.add(w)
        else:
            assert isinstance(data, torch.Tensor)   # top-k's pairs come dense outside a barrier round (_checked)
            try:
                if s.mode == "geo":
                    st.apply_delta(data, staleness, s.workers / len(s.live))
                else:
                    skipped = st.apply_gradient(data, staleness, w, float(h.get("scale", 1.0)), found_inf)
            except NonFiniteUpdate as e:   # a finite push that overflows the update: refused as a non-finite one
                s.refused_non_finite[w] += 1
                raise NonFinitePush(f"push: worker {w}'s {'delta' if s.mode == 'geo' else 'gradient'} for step "
                                    f"{h['step']}: {e}: refused, nothing applied") from None
        self.applied += 1
        part.clock[w] = h["step"] + 1
        if s.mode == "ssp" and len(s.trace) < TRACE_LIMIT:
            s.trace.append([0, w, part.clock[w]])
        reply: AckFields = {}
        if not s.barrier:
            reply["staleness"] = staleness
        if skipped is not None:
            reply["skipped"] = skipped
        return reply

    def _checked(self, msg: wire.Message, part: Partition) -> tuple[int, torch.Tensor | Pairs, bool]:
        """(worker, payload decoded, found_inf) of a push that passes every check; PSError, changing nothing, else."""
        s, h = self.state, msg.header
        w, st = s.sender(msg, lost_ok=part.follows), part.range
        sparse = msg.op.startswith("sparse")
        if sparse != (s.cfg.train.compression == "topk"):
            raise PSError(f"{msg.op}: this run's pushes are " + ("whole partitions (push, pushpull)" if sparse else
                                                                 "top-k pairs (sparsepush, sparsepushpull)"))
        if msg.op.endswith(("pushpull", "pushpulldelta")) and (msg.op in wire.DELTA_PULLS) != s.pulls_deltas:
            raise PSError(f"{msg.op}: this run's pulls " + ("carry compressed deltas (pushpulldelta, "
                                                            "sparsepushpulldelta: GEO with train.compression)"
                                                            if s.pulls_deltas else "carry parameters whole"))
        keys = check_pairs(msg, s.push_dtype, part.lo, part.hi, s.cfg.train.topk_ratio) if sparse else None
        if keys is None:
            check_range(msg, s.push_dtype, part.lo, part.hi)
        if h["version"] != st.sent_version[w]:
            raise PSError(f"push: worker {w} says it computed on version {h['version']}, this server last sent "
                          f"it version {st.sent_version[w]}")
        if s.barrier:
            if part.follows and h["step"] < st.version and w not in part.round.last_members:
                raise WorkerLost(f"push: worker {w} sent step {h['step']}, which went on without it (server "
                                 f"{s.index} is at step {st.version})", st.version)
            if h["step"] != st.version:
                raise PSError(f"push: worker {w} sent step {h['step']}, the current round is step {st.version}")
            if w in part.round.pushed:
                raise PSError(f"push: worker {w} already pushed step {h['step']}")
        elif h["step"] != part.clock[w]:
            raise PSError(f"push: worker {w} sent step {h['step']}, its next step is {part.clock[w]}")
        self._check_scale(w, h, st)
        scratch = s.scratch[:part.hi - part.lo]
        into = (scratch if not s.barrier or keys is not None else torch.empty_like(scratch) if part.follows else
                part.round.sum.destination(w, s.live, part.round.pushed, st.acc, scratch))
        found_inf = bool(h.get("found_inf", False))
        try:  # poison never reaches the parameters: only fp16's declared overflow steps may hold inf/nan
            # (a refused first push of a round leaves acc half-written: the next first push overwrites it)
            finite = not (s.loss_scaling and found_inf)
            if keys is None:
                return w, msg.tensor(into, finite=finite), found_inf
            pairs = Pairs(keys, msg.tensor(finite=finite).view(-1))   # summed sparsely in a round (rounds.py)
            return w, pairs if s.barrier else pairs.dense(scratch), found_inf
        except wire.NonFinitePayload:
            s.refused_non_finite[w] += 1
            what = "delta" if s.mode == "geo" else "gradient"
            said = " (it says found_inf = false)" if s.loss_scaling else ""
            raise NonFinitePush(f"push: worker {w}'s {what} for step {h['step']} holds inf/nan{said}: "
                                f"refused, nothing applied") from None

    def _check_scale(self, w: int, h: dict[str, Any], st: RangeState) -> None:
        """`scale` and `found_inf` belong to fp16 runs whose server optimizer scales the loss."""
        s = self.state
        sent = [k for k in ("scale", "found_inf") if k in h]
        if not s.loss_scaling:
            if sent:
                raise PSError(f"push: field {sent[0]!r} is sent only in fp16 runs with a server optimizer "
                              f"(this run: train.precision = {s.cfg.train.precision!r}, mode {s.mode!r})")
            return
        if "scale" not in h:
            raise PSError(f"push: worker {w} sent no 'scale': an fp16 push names the loss scale it was computed with")
        scale = h["scale"]
        assert st.optim is not None   # loss scaling: fp16 with a server optimizer
        # every scale a server hands out is a power of two >= the scaler's minimum (2^16, halved, doubled)
        if scale < st.optim.scaler.min_scale or math.frexp(scale)[0] != 0.5:
            raise PSError(f"push: scale {scale!r}: expected a power of two >= {st.optim.scaler.min_scale:g}, "
                          f"a loss scale this server could have sent")
        if s.barrier and scale != st.scale:
            raise PSError(f"push: scale {scale:g}, this server's loss scale for step {st.version} is {st.scale:g}")

    def complete_round(self, part: Partition) -> None:
        """Apply the partition's round once every live worker has pushed it (a replica that follows: once it has
        the pushes its first holder summed), the round's rows first, with the first partition to complete it,
        then the partition's dense sum."""
        s = self.state
        r, st = part.round, part.range
        if not s.barrier or not r.pushed:
            return
        members = self._members(part)
        if members is None:
            return
        if not r.sum.complete(members):   # a bug: never apply a sum missing a push
            return self.replies.fail(f"internal error: round {st.version} has pushes {sorted(r.pushed)}, summed "
                                     f"{sorted(r.sum.summed)}, still kept {sorted(r.sum.early)}")
        version = st.version
        with_rows = self.rows if self.rows is not None and self.rows.first_to_complete(st.version) else None
        try:   # the rows' update is checked first, stored last: a refused round changes nothing
            # sync: the mean gradient over the round's pushes (all N workers', or those left once some were
            # lost: a worker's shard of the global batch goes with it), as the dense range; geo: deltas
            # arrive divided by N
            rows = (with_rows.round_update(1 / len(members) if s.mode == "sync" else s.workers / len(members))
                    if with_rows is not None else None)
            if s.mode == "sync":
                r.last_skipped = st.apply_mean(len(members), bool(r.infs & members))
                r.last_members = members
            else:  # workers divide their deltas by N: the mean over the deltas this round actually has
                st.apply_sum(s.workers / len(members))
        except NonFiniteUpdate as e:   # no one push is to blame: the round cannot be applied, the run stops
            where = f", partition [{part.lo}, {part.hi})" if len(s.parts) > 1 else ""
            return self.replies.fail(f"{s.mode} step {st.version}{where}: the round of workers {sorted(members)}: "
                                     f"{e}: not applied")
        if with_rows is not None:
            with_rows.end_round(rows)
        if self.timeline is not None and version in self.traced:   # r.since is time.monotonic()'s
            now = time.perf_counter()
            self.timeline.add("rounds", f"round {version} [{part.lo}, {part.hi})",
                              now - (time.monotonic() - r.since), now)
        r.pushed.clear()
        r.sum.clear()
        r.infs.clear()
        r.members = None

    def _members(self, part: Partition) -> frozenset[int] | None:
        """The workers the partition's round sums, once it may complete (None until then), their pushes summed in
        worker order: every live worker's, or a follower's, those its first holder summed (the rest dropped)."""
        s, r, acc = self.state, part.round, part.range.acc
        if part.follows:
            if r.members is None or not r.pushed >= r.members:
                return None
            r.sum.drop(r.pushed - r.members)
            r.sum.drain(acc, set(r.members), set(r.members))
            return r.members
        r.sum.drain(acc, s.live, r.pushed)   # a push or a loss may fill the gap
        return frozenset(r.pushed) if r.pushed >= s.live else None
