"""One parameter server: a ZeroMQ ROUTER that owns range [lo, hi) of the flat fp32 parameter vector.

The servers of a run build the initial parameters from the config themselves (`initialize`; the range
follows from the total size and this server's index). Requests (see wire.py): `init` (only for a
server started without parameters: a client sends them), `push` (gradients, or deltas in geo),
`pull` (the parameters for the worker's next step; answered when the mode allows), `pushpull` (both
in one message: what workers send each step), `fetch` (an fp32 snapshot at once), `done`, `save` (snapshot.py).
Every request gets exactly one reply, in order: `ack`, `params` or `error`. A request that fails any
check gets an error reply and changes nothing; only the sync/ssp/geo-barrier timeouts fail the server
(and a bug caught while a request was being applied: the state can no longer be trusted).

The server, not the worker, is the authority on what a worker may send: a push must be that worker's
next step and name the version this server last sent it (staleness is computed from the server's own
record); a pull may ask for no step beyond the worker's next one, and a worker waits for one pull at a
time. In fp16 a push carries the loss scale it was computed with (a power of two >= the scaler's
minimum, in sync exactly the server's) and its inf/nan verdict, which the server checks on its range.
Every push, in every mode and precision, is checked for inf/nan frame by frame as it is decoded, before
it touches the parameters: one that holds any (outside fp16's declared overflow steps) is refused with
code "non_finite" and counted for its worker, and the worker stops the run.

A barrier round's sum is added in worker order, whatever order the pushes arrive in (rounds.py): its bits do
not depend on timing, so two runs, and a run and its resume, are bit-identical at any N.

When a pull is answered depends on the mode (pulls.py). A pull that waits more than `backend.timeout_s` fails the server with an error naming the workers it
waits for; every waiting and later request then gets that error, and the launcher stops the run.
A worker is lost when the launcher says its process died, or (a standalone server, which has no
launcher, in the modes that go on without it) when nothing came from it for `backend.timeout_s`
while it had no pull waiting; the server then stops waiting for it, and exits once every worker is
done or lost.

Who may connect (psarch/ps/auth.py): every connection authenticates (PLAIN or CURVE through ZAP, by
default), and each request must name the worker its connection authenticated as; one that does not is
refused before anything else, with an error that carries no state, and counts for nothing (done, fetch,
silence clocks). Heartbeats drop stalled peers; MAXMSGSIZE caps each frame at the largest legitimate one.
Still not bounded: ZeroMQ hands over a multipart message only once all of it has arrived, so an
authenticated worker can make its server buffer a message of many frames before decode refuses it.
"""
from __future__ import annotations

import json
import math
import sys
import time
import traceback
from typing import Any

import torch
import zmq

from psarch.config import Config
from psarch.meters import TrafficMeter
from psarch.precision import compute_dtype
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from psarch.ps.control import ServerControl
from psarch.ps.pulls import TRACE_LIMIT, PullQueue, _Pull
from psarch.ps.rounds import OrderedSum
from psarch.ps.snapshot import ServerSnapshots
from psarch.ps.errors import NonFinitePush, PSError
from psarch.ps.client import REPLY_TO
from psarch.ps.layout import server_ranges
from psarch.ps.updates import RangeState



class ParameterServer(PullQueue, ServerControl, ServerSnapshots):
    """Serve one range of the parameters until `stop()` (or a `stop` command on the control pipe)."""

    def __init__(self, index: int, cfg: Config, host: str = "127.0.0.1", port: int = 0,
                 control: Any = None, exit_when_done: bool = False, creds: Credentials | None = None,
                 numel: int | None = None, checkpoints: Any = None) -> None:
        """creds: who may connect (None: from backend.auth and backend.keys, as a standalone server);
        numel: the parameter count, when known before the socket binds (caps a frame at this range);
        checkpoints: the run's checkpoint folder, the only place a `save` may write (None: no saves)."""
        b = cfg.backend
        self.index, self.cfg, self.workers, self.mode = index, cfg, b.world_size, b.mode
        self.barrier = b.mode == "sync" or (b.mode == "geo" and b.geo_barrier)
        self.timeout_s = b.timeout_s
        self.wire_dtype = wire.DTYPE_NAMES[compute_dtype(cfg.train.precision)]
        # pushes carry a loss scale and an inf/nan verdict only where a server optimizer scales the loss
        self.loss_scaling = cfg.train.precision == "fp16" and b.mode != "geo"
        self.creds = creds if creds is not None else auth.standalone_credentials(cfg, host)
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # ZeroMQ drops a connection whose frame exceeds this as the frame's size arrives, before buffering it
        self.sock.setsockopt(zmq.MAXMSGSIZE, auth.max_frame(numel, b.servers))
        auth.bound(self.sock, b.heartbeat_s, b.heartbeat_timeout_s)
        auth.server_socket(self.sock, self.creds, index)
        self.zap = auth.ZapHandler(self.zctx, self.sock, self.creds, self.workers,
                                   b.max_connections or self.workers + 16)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self.control = control
        self.meter = TrafficMeter()
        self.state: RangeState | None = None
        self.lo = self.hi = 0
        self.scratch: torch.Tensor | None = None
        self.round_pushed: set[int] = set()
        self.round_sum = OrderedSum(self.workers)   # barrier modes: the round's pushes summed in worker order
        self.round_since = 0.0
        self.round_inf = False
        self.last_skipped = False
        self.clock = [0] * self.workers            # pushes applied per worker (= its next step)
        self.lost: set[int] = set()
        self.done: set[int] = set()
        self.pending: list[_Pull] = []
        self.failure: str | None = None
        self.rejected = 0
        self.impostors = 0                             # requests naming a worker other than their connection's
        self.refused_non_finite = [0] * self.workers   # pushes refused for inf/nan, per worker
        self.max_ahead = 0
        # ssp: [0, worker, steps pushed] per push, [1, worker, step] per pull granted
        self.trace: list[list[int]] = []
        self.stopping = False
        self.exit_when_done = exit_when_done     # standalone: stop once every worker is done (or 10 s after a failure)
        self.failed_at: float | None = None
        # standalone, modes that go on without a worker: when each worker was last heard from (None until
        # the first worker speaks, so that workers started long after the server are not lost at once)
        self.watch_silence = exit_when_done and b.mode != "sync"
        # a GEO worker speaks once per k_steps local steps: its silence may last k_steps times longer
        self.silence_s = b.timeout_s * (b.k_steps if b.mode == "geo" else 1)
        self.last_seen: list[float] | None = None
        self.changing = False                    # the current request has started to change the state
        self.current: bytes | None = None        # the identity of the request being handled
        self.current_answered = False            # ... and whether it has had its one reply
        self._init_snapshots(checkpoints)

    # ------------------------------------------------------------------ loop

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for z in self.zap.sockets():
            poller.register(z, zmq.POLLIN)
        if self.control is not None:
            poller.register(self.control.fileno(), zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll(100))
            self.zap.handle(events)
            if self.sock in events:
                # a burst, then look at the control pipe and the clock again
                for _ in range(64):
                    if not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    self.handle(self.sock.recv_multipart(copy=False))
            if self.control is not None and self.control.poll():
                self._control(json.loads(self.control.recv_bytes()))
            self._check_deadlines()
        self.close()

    def stop(self) -> None:
        self.stopping = True

    def close(self) -> None:
        self.zap.close()
        self.sock.close(linger=500)  # let the last replies (a standalone server's final acks) leave
        self.zctx.term()

    # ------------------------------------------------------------------ requests

    def handle(self, frames: list) -> None:
        """Handle one message from the ROUTER (identity frame first)."""
        ident, body = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0]), frames[1:]
        size = wire.frames_bytes(body)
        try:
            msg = wire.decode(body)
        except Exception as e:  # WireError; anything else is a decoder bug, but never a reason to crash
            self.meter.add("invalid", 0, size)
            text = str(e) if isinstance(e, wire.WireError) else f"undecodable message ({type(e).__name__}: {e})"
            return self._error(ident, "invalid", text)
        self.meter.add(msg.op, 0, size)
        stranger = auth.stranger(self.creds, body[0], msg.header.get("worker"))
        if stranger:   # a worker acts only as itself; the reply tells it nothing of the state
            self.impostors += 1
            return self._error(ident, msg.op, stranger)
        self._heard(msg.header.get("worker"))
        self._save_heard(msg.header.get("worker"))
        self.changing = False
        self.current, self.current_answered = ident, False
        try:
            if self.failure is not None:
                raise PSError(self.failure)
            handler = getattr(self, f"_on_{msg.op}", None)
            if handler is None:
                raise PSError(f"op {msg.op!r}: this server holds no embedding rows (backend.embeddings = \"rows\" "
                              f"starts servers that do)" if msg.op in REPLY_TO else
                              f"op {msg.op!r} is a reply, not a request")
            handler(ident, msg)
        except (PSError, wire.WireError) as e:
            self._error(ident, msg.op, str(e), getattr(e, "code", None))
        except Exception as e:  # a bug: no request may end the serve loop, and none may hide a bug either
            print(f"psarch server {self.index}: internal error handling {msg.op!r} of worker "
                  f"{msg.header.get('worker')}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            text = f"internal error: {type(e).__name__}: {e}"
            if self.changing:  # the state may be half-updated: fail rather than serve from it
                self._fail(f"{text} (while applying {msg.op!r} of worker {msg.header.get('worker')})")
            if not self.current_answered:  # every request gets exactly one reply
                self._error(ident, msg.op, text)

    def _heard(self, worker: Any) -> None:
        if not self.watch_silence or not isinstance(worker, int) or not 0 <= worker < self.workers:
            return
        now = time.monotonic()
        if self.last_seen is None:
            self.last_seen = [now] * self.workers   # the run has begun: every worker's silence counts from now
        self.last_seen[worker] = now

    def _send(self, ident: bytes, op: str, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        frames = wire.encode(header, tensor)
        self.meter.add(op, wire.frames_bytes(frames), 0, calls=0)
        self.sock.send_multipart([ident, *frames], copy=False)
        if ident == self.current:
            self.current_answered = True

    def _error(self, ident: bytes, op: str, text: str, code: str | None = None) -> None:
        self.rejected += self.failure is None
        header = {"op": "error", "message": f"server {self.index}: {text}"[:4000]}
        self._send(ident, op, dict(header, code=code) if code else header)

    def _worker(self, msg: wire.Message) -> int:
        w = msg.header["worker"]
        if w >= self.workers:
            raise PSError(f"worker {w}: this run has workers 0..{self.workers - 1}")
        if w in self.lost:
            raise PSError(f"worker {w} was declared lost")
        return w

    def _check_tensor(self, msg: wire.Message, dtype: str) -> None:
        h = msg.header
        if h["offset"] != self.lo or msg.shape != (self.hi - self.lo,):
            raise PSError(f"op {msg.op!r}: range offset {h['offset']} shape {list(msg.shape)}, this server owns "
                          f"[{self.lo}, {self.hi}) (offset {self.lo}, shape [{self.hi - self.lo}])")
        if h["dtype"] != dtype:
            raise PSError(f"op {msg.op!r}: dtype {h['dtype']}, this run's wire dtype is {dtype}")

    def initialize(self, flat: torch.Tensor) -> None:
        """Start from the whole initial parameter vector (servers of a run build it from the config)."""
        self.lo, self.hi = server_ranges(flat.numel(), self.cfg.backend.servers)[self.index]
        self.state = RangeState(flat[self.lo:self.hi], self.cfg, self.workers)
        self.scratch = torch.empty(self.hi - self.lo, dtype=compute_dtype(self.cfg.train.precision))

    def _on_init(self, ident: bytes, msg: wire.Message) -> None:
        """A server started without parameters (benchmarks, tests) takes them from one `init`."""
        self._worker(msg)
        if self.state is not None:
            raise PSError("init: the parameters are already initialised")
        try:
            self.lo, self.hi = server_ranges(msg.header["numel"], self.cfg.backend.servers)[self.index]
        except ValueError as e:
            raise PSError(f"init: {e}") from None
        try:
            self._check_tensor(msg, "float32")
        except PSError:
            self.lo = self.hi = 0
            raise
        self.changing = True
        self.state = RangeState(msg.tensor(), self.cfg, self.workers)
        self.scratch = torch.empty(self.hi - self.lo, dtype=compute_dtype(self.cfg.train.precision))
        self._send(ident, "init", {"op": "ack", "version": 0})
        self._serve_pending()

    def _on_push(self, ident: bytes, msg: wire.Message) -> None:
        reply = self._apply_push(msg)
        self._send(ident, "push", dict(reply, op="ack", version=self.state.version))
        self._complete_round()
        self._serve_pending()

    def _on_pushpull(self, ident: bytes, msg: wire.Message) -> None:
        """A push, then a pull for the next step, answered by one `params` reply (half the messages)."""
        self._check_one_pull(self._worker(msg), "pushpull")
        extra = self._apply_push(msg)
        self.pending.append(_Pull(ident, "pushpull", msg.header["worker"], msg.header["step"] + 1,
                                  time.monotonic(), extra))
        self._complete_round()
        self._serve_pending()

    def _apply_push(self, msg: wire.Message) -> dict[str, Any]:
        """Validate a push (raise PSError, changing nothing) and apply it; returns the ack's fields."""
        w, h, st = self._worker(msg), msg.header, self.state
        if st is None:
            raise PSError("push before init: no parameters yet")
        self._check_tensor(msg, self.wire_dtype)
        if h["version"] != st.sent_version[w]:
            raise PSError(f"push: worker {w} says it computed on version {h['version']}, this server last sent "
                          f"it version {st.sent_version[w]}")
        if self.barrier:
            if h["step"] != st.version:
                raise PSError(f"push: worker {w} sent step {h['step']}, the current round is step {st.version}")
            if w in self.round_pushed:
                raise PSError(f"push: worker {w} already pushed step {h['step']}")
        elif h["step"] != self.clock[w]:
            raise PSError(f"push: worker {w} sent step {h['step']}, its next step is {self.clock[w]}")
        self._check_scale(w, h)
        into = (self.round_sum.destination(w, self._live(), self.round_pushed, st.acc, self.scratch)
                if self.barrier else self.scratch)
        found_inf = bool(h.get("found_inf", False))
        try:  # poison never reaches the parameters: only fp16's declared overflow steps may hold inf/nan
            # (a refused first push of a round leaves acc half-written: the next first push overwrites it)
            data = msg.tensor(into, finite=not (self.loss_scaling and found_inf))
        except wire.NonFinitePayload:
            self.refused_non_finite[w] += 1
            what = "delta" if self.mode == "geo" else "gradient"
            said = " (it says found_inf = false)" if self.loss_scaling else ""
            raise NonFinitePush(f"push: worker {w}'s {what} for step {h['step']} holds inf/nan{said}: "
                                f"refused, nothing applied") from None
        # every check passed: from here on the message is applied
        self.changing = True
        staleness = st.version - st.sent_version[w]
        skipped = None
        if self.barrier:
            self.round_sum.add(w, data, st.acc, self._live(), self.round_pushed)
            self.round_inf |= found_inf
            if not self.round_pushed:
                self.round_since = time.monotonic()
            self.round_pushed.add(w)
        elif self.mode == "geo":
            st.apply_delta(data, staleness, self.workers / len(self._live()))
        else:
            skipped = st.apply_gradient(data, staleness, w, float(h.get("scale", 1.0)), found_inf)
        self.clock[w] = h["step"] + 1
        if self.mode == "ssp" and len(self.trace) < TRACE_LIMIT:
            self.trace.append([0, w, self.clock[w]])
        reply: dict[str, Any] = {}
        if not self.barrier:
            reply["staleness"] = staleness
        if skipped is not None:
            reply["skipped"] = skipped
        return reply

    def _check_scale(self, w: int, h: dict[str, Any]) -> None:
        """`scale` and `found_inf` belong to fp16 runs whose server optimizer scales the loss."""
        sent = [k for k in ("scale", "found_inf") if k in h]
        if not self.loss_scaling:
            if sent:
                raise PSError(f"push: field {sent[0]!r} is sent only in fp16 runs with a server optimizer "
                              f"(this run: train.precision = {self.cfg.train.precision!r}, mode {self.mode!r})")
            return
        if "scale" not in h:
            raise PSError(f"push: worker {w} sent no 'scale': an fp16 push names the loss scale it was computed with")
        scale, st = h["scale"], self.state
        # every scale a server hands out is a power of two >= the scaler's minimum (2^16, halved, doubled)
        if scale < st.optim.scaler.min_scale or math.frexp(scale)[0] != 0.5:
            raise PSError(f"push: scale {scale!r}: expected a power of two >= {st.optim.scaler.min_scale:g}, "
                          f"a loss scale this server could have sent")
        if self.barrier and scale != st.scale:
            raise PSError(f"push: scale {scale:g}, this server's loss scale for step {st.version} is {st.scale:g}")

    def _complete_round(self) -> None:
        st = self.state
        if not self.barrier or not self.round_pushed:
            return
        self.round_sum.drain(st.acc, self._live(), self.round_pushed)   # a push or a loss may fill the gap
        if not self.round_pushed >= self._live():
            return
        if not self.round_sum.complete(self.round_pushed):   # a bug: never apply a sum missing a push
            return self._fail(f"internal error: round {st.version} has pushes {sorted(self.round_pushed)}, summed "
                              f"{sorted(self.round_sum.summed)}, still kept {sorted(self.round_sum.early)}")
        if self.mode == "sync":
            self.last_skipped = st.apply_mean(self.workers, self.round_inf)
        else:  # workers divide their deltas by N: the mean over the deltas this round actually has
            st.apply_sum(self.workers / len(self.round_pushed))
        self.round_pushed.clear()
        self.round_sum.clear()
        self.round_inf = False

    def _on_fetch(self, ident: bytes, msg: wire.Message) -> None:
        self._worker(msg)
        if self.state is None:
            raise PSError("fetch before init: no parameters yet")
        self._send(ident, "fetch", {"op": "params", "version": self.state.version, "offset": self.lo},
                   self.state.params.detach().clone())

    def _on_done(self, ident: bytes, msg: wire.Message) -> None:
        self.done.add(self._worker(msg))
        self._send(ident, "done", {"op": "ack", "version": self.state.version if self.state else 0})
        self._exit_if_over()

    def _exit_if_over(self) -> None:
        if self.exit_when_done and self.done >= self._live():
            self.stopping = True

    def _lose(self, w: int, why: str) -> None:
        """Go on without worker w: drop its waiting pulls, finish what waited for it."""
        if w in self.lost:
            return
        self.lost.add(w)
        self.pending = [p for p in self.pending if p.worker != w]
        if self.exit_when_done:
            print(f"psarch server {self.index}: worker {w} lost: {why}", file=sys.stderr, flush=True)
        if self.state is not None and self.failure is None:
            self._complete_round()
            self._serve_pending()
            self._save_if_all()
        self._exit_if_over()
