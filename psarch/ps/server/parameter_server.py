"""One parameter server: a ZeroMQ ROUTER that owns range [lo, hi) of the flat fp32 parameter vector (or, dealt
round robin, every k-th partition of it: partitions.server_partitions).

The servers of a run build the initial parameters from the config themselves (`initialize`; the range
follows from the total size and this server's index). Requests (see psarch/ps/wire.py): `init` (only for a
server started without parameters: a client sends them), `push` (gradients, or deltas in geo),
`pull` (the parameters for the worker's next step; answered when the mode allows), `pushpull` (both
in one message: what workers send each step), `fetch` (an fp32 snapshot at once), `done`, `save` (snapshots.py).
Every request gets exactly one reply, in order: `ack`, `params` or `error` (replies.py); a request its worker sent
again (the same id: its connection dropped, or no reply came in backend.resend_timeout_s) is applied once
(repeats.py). A request that fails any
check gets an error reply and changes nothing; only a pull that waits past backend.timeout_s fails the server
(and a bug caught while a request was being applied: the state can no longer be trusted).

The range is held in partitions (state.py's Partition, backend.partition_mb): push, pushpull and pull name one
by its offset, and each is versioned, clocked, rounded and answered on its own, as a server of its own would be.

The server is built by composition: its state is one dataclass (state.py) handed to each part, and each
request goes to its part through one handler table (`handlers`): pushes and the range (pushes.py: the
server, not the worker, is the authority on what a worker may send; non-finite pushes are refused; a barrier
round's sum goes in worker order, rounds.py, so its bits do not depend on timing), waiting pulls (pulls.py:
when a pull is answered depends on the mode), checkpoints (snapshots.py), and with `backend.embeddings =
"rows"` the embedding rows (rows.py). A pull that waits more than `backend.timeout_s` fails the server with an
error naming the workers it waits for (deadlines.py); every waiting and later request then gets that error,
and the launcher stops the run.
A worker is lost when the launcher says its process died, when a barrier round (sync, GEO with the barrier) has
waited `backend.timeout_s` for its push (dead, hung or stopped: the round goes on with the others), or (a
standalone server, which has no launcher) when nothing came from it for `backend.timeout_s` while it had no pull
waiting; the server then stops waiting for it, and exits once every worker is done or lost. A lost sync worker
that comes back (a pause, a slow step) is taken back at a later round (readmit.py); elsewhere, and after its
process died, a lost worker is refused ("declared lost") and leaves the run.

Who may connect (psarch/ps/auth.py): every connection authenticates (PLAIN or CURVE through ZAP, by
default), and each request must name the worker its connection authenticated as; one that does not is
refused before anything else, with an error that carries no state, and counts for nothing (done, fetch,
silence clocks). Heartbeats drop stalled peers; MAXMSGSIZE caps each frame at the largest legitimate one, and
wire.MAX_FRAMES the frames of a message (one with more drops its connection, unparsed); what one connection may
make the server hold (a message not yet complete, replies not yet read) and how many connections each worker
and strangers may hold are bounded by connections.py; no routing id a peer chooses can make libzmq abort the
server (libc.py).
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any, Callable

import torch
import zmq

from psarch.config import Config
from psarch.meters import TrafficMeter
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from psarch.ps.errors import PSError, WorkerLost
from psarch.ps.layout import gather, held, held_partitions, server_partitions
from psarch.ps.partitions import replicas
from psarch.ps.server.commits import Commits
from psarch.ps.server.connections import Caps, Connections
from psarch.ps.server.tcp_bytes import copy_received_frames, exchange_budget
from psarch.ps.server.deadlines import Deadlines
from psarch.ps.server.readmit import Readmissions
from psarch.ps.server.libc import seed_routing_ids
from psarch.ps.server.pulls import PullQueue
from psarch.ps.server.pushes import Pushes
from psarch.ps.server.repeats import Repeats
from psarch.ps.server.replies import Replies
from psarch.ps.server.rows import ServerRows
from psarch.ps.server.snapshots import Snapshots
from psarch.ps.server.state import ServerState
from psarch.ps.server.stats import Command, final_params, server_stats
from psarch.timeline import Recorder

Handler = Callable[[bytes, wire.Message], None]
LOST_BY_LAUNCHER = "its process died"
DEADLINE_PERIOD_S = 0.01   # how often the serve loop checks the clocks (deadlines.py), at most


class ParameterServer:
    """Serve one range of the parameters until `stop()` (or a `stop` command on the launcher's pipe)."""

    def __init__(self, index: int, cfg: Config, host: str = "127.0.0.1", port: int = 0, pipe: Any = None,
                 exit_when_done: bool = False, creds: Credentials | None = None, numel: int | None = None,
                 checkpoints: Any = None, tables_only: bool = False) -> None:
        """pipe: the launcher's (None: a standalone server); exit_when_done: stop once every worker is done or
        lost; creds: who may connect (None: from backend.auth and backend.keys, as a standalone server);
        numel: the parameter count, when known before the socket binds (caps a frame at this range);
        checkpoints: the run's checkpoint folder, the only place a `save` may write (None: no saves);
        tables_only: the hybrid's server (collective/ps_tables.py): embedding rows and no dense range."""
        b = cfg.backend
        self.state = ServerState(index, cfg, exit_when_done)
        self.creds = creds if creds is not None else auth.standalone_credentials(cfg, host)
        self.zctx = zmq.Context()
        copy_received_frames(self.zctx)
        seed_routing_ids()   # before the ROUTER: the ids it makes up for peers must not be guessable (libc.py)
        self.sock = self.zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # ZeroMQ drops a connection whose frame exceeds this as the frame's size arrives, before buffering it
        widest = None if numel is None else max(map(held, held_partitions(cfg, numel)))
        self.sock.setsockopt(zmq.MAXMSGSIZE, auth.max_frame(widest))
        # with replicas no heartbeats, here as at the workers (worker/client.py): a connection drops only where a
        # process died, not where one was stopped for a while
        heartbeat_s = 0.0 if replicas(cfg) else b.heartbeat_s
        auth.bound(self.sock, heartbeat_s, b.heartbeat_timeout_s, b.handshake_timeout_s)
        auth.server_socket(self.sock, self.creds, index)
        self.rows = None   # (set below: the connections' budget reads it)
        caps = Caps(b.max_connections or b.world_size + 16, b.max_connections_per_worker,
                    b.max_pending or b.world_size + 16, b.handshake_timeout_s)
        self.connections = Connections(self.sock, self.inflight_budget, heartbeat_s, caps,
                                       curve=self.creds.mechanism == "curve", name=f"server {index}")
        self.zap = auth.ZapHandler(self.zctx, self.creds, b.world_size, self.connections.admit)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.port, self.address = port, f"tcp://{host}:{port}"
        self.pipe = pipe
        self.meter = TrafficMeter()
        s, replies = self.state, Replies(self.sock, self.meter, self.state, pipe, self.connections)
        self.replies = replies
        self.rows = ServerRows(s, replies, tables_only) if b.embeddings == "rows" else None
        self.pulls = PullQueue(s, replies)
        self.timeline = Recorder()
        self.timeline.on = bool(cfg.train.trace_steps)
        self.pushes = Pushes(s, replies, self.pulls, self.rows, self.timeline)
        self.snapshots = Snapshots(s, replies, checkpoints, self.rows)
        self.readmit = Readmissions(s, replies)
        self.repeats = Repeats(s, replies, self.pulls)
        self.deadlines = Deadlines(s, replies, self.readmit)
        self.handlers: dict[str, Handler] = {
            "init": self.pushes.on_init, "push": self.pushes.on_push, "pushpull": self.pushes.on_pushpull,
            "sparsepush": self.pushes.on_push, "sparsepushpull": self.pushes.on_pushpull,
            "pushpulldelta": self.pushes.on_pushpull, "sparsepushpulldelta": self.pushes.on_pushpull,
            "pull": self.pulls.on_pull, "fetch": self.pushes.on_fetch, "save": self.snapshots.on_save,
            "commit": Commits(s, replies, self.pushes, self.pulls, self.readmit).on_commit,
            "done": self.on_done, "rejoin": lambda ident, msg: self.readmit.on_rejoin(ident, msg, self.lose),
            **(self.rows.handlers() if self.rows is not None else {})}

    def initialize(self, flat: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Start from the whole initial parameter vector (servers of a run build it from the config) and, with
        embedding rows, this server's rows of the initial tables."""
        s = self.state
        parts = held_partitions(s.cfg, flat.numel())[s.index]   # its own and, with replicas, the r before it
        own = server_partitions(s.cfg, flat.numel())[s.index]
        s.hold(parts, gather(flat, parts), flat.numel(), frozenset(parts) - frozenset(own))
        if self.rows is not None:
            if rows is None:
                raise ValueError("backend.embeddings = \"rows\": a server starts from its rows of the tables too")
            self.rows.start(rows)

    # ------------------------------------------------------------------ loop

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        self.zap.start()
        pipe_fd = self.pipe.fileno() if self.pipe is not None else None
        if pipe_fd is not None:
            poller.register(pipe_fd, zmq.POLLIN)
        next_check = 0.0
        while not self.state.stopping:
            events = dict(poller.poll(100))
            if self.sock in events:
                # a burst, then look at the launcher's pipe and the clock again
                for _ in range(64):
                    if not auth.readable(self.sock):
                        break
                    frames = self.receive()
                    if frames is not None:
                        self.handle(frames)
            if pipe_fd in events and self.pipe.poll():   # (the poller says when the pipe has a command)
                self.command(json.loads(self.pipe.recv_bytes()))
            now = time.monotonic()
            if now >= next_check:   # the clocks walk every partition and pull: not after every message
                next_check = now + DEADLINE_PERIOD_S
                self.check_deadlines()
        self.close()

    def receive(self) -> list | None:
        """The next message, or None for one of more than wire.MAX_FRAMES frames: its connection is dropped and
        the rest of it read and thrown away, a frame at a time (ZeroMQ reads no other message until this one is
        read, and keeps no more of it than the connection's budget)."""
        frames = [self.sock.recv(copy=False)]
        while frames[-1].more:
            if len(frames) > wire.MAX_FRAMES:
                self.connections.drop_sender(frames[0], "frames")
                size, frame = wire.frames_bytes(frames[1:]), frames[-1]
                while frame.more:
                    frame = self.sock.recv(copy=False)
                    size += len(frame)
                self.meter.add("invalid", 0, size)
                return None
            frames.append(self.sock.recv(copy=False))
        return frames

    def stop(self) -> None:
        self.state.stopping = True

    def close(self) -> None:
        self.connections.close()
        self.zap.close()
        self.sock.close(linger=500)  # let the last replies (a standalone server's final acks) leave
        self.zctx.term()

    # ------------------------------------------------------------------ requests

    def handle(self, frames: list) -> None:
        """Handle one message from the ROUTER (identity frame first): its part's handler, one reply."""
        s = self.state
        if not self.connections.received(frames):
            return   # its connection is dropped: no one to answer
        ident, body = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0]), frames[1:]
        size = wire.frames_bytes(body)
        try:
            msg = wire.decode(body)
        except Exception as e:  # WireError; anything else is a decoder bug, but never a reason to crash
            self.meter.add("invalid", 0, size)
            text = str(e) if isinstance(e, wire.WireError) else f"undecodable message ({type(e).__name__}: {e})"
            return self.replies.error(ident, "invalid", text)
        self.meter.add(s.booked(msg.op, msg.header.get("offset")), 0, size)
        stranger = auth.stranger(self.creds, body[0], msg.header.get("worker"))
        if stranger:   # a worker acts only as itself; the reply tells it nothing of the state
            s.impostors += 1
            return self.replies.error(ident, msg.op, stranger)
        s.heard(msg.header.get("worker"))
        self.snapshots.heard(msg.header.get("worker"))
        s.changing = False
        s.current, s.current_answered = ident, False
        try:
            if "rid" in msg.header:   # a request its worker may send again: a repeat is applied once (repeats.py)
                ret = self.repeats.arrived(ident, msg)
                if ret is None:
                    return
                s.current = ident = ret
            if s.failure is not None:
                raise PSError(s.failure)
            handler = self.handlers.get(msg.op)
            if handler is None:
                raise PSError(f"op {msg.op!r}: this server holds no embedding rows (backend.embeddings = \"rows\" "
                              f"starts servers that do)" if msg.op in wire.REPLY_TO else
                              f"op {msg.op!r} is a reply, not a request")
            handler(ident, msg)
        except (PSError, wire.WireError) as e:
            self.replies.error(ident, msg.op, str(e), getattr(e, "code", None), getattr(e, "version", None))
        except Exception as e:  # a bug: no request may end the serve loop, and none may hide a bug either
            self._internal_error(ident, msg, e)
        if self.readmit.held and s.failure is None:   # a round this request completed may be a held rejoin's
            self.readmit.serve()

    def _internal_error(self, ident: bytes, msg: wire.Message, e: Exception) -> None:
        s, who = self.state, msg.header.get("worker")
        print(f"psarch server {s.index}: internal error handling {msg.op!r} of worker {who}:\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        text = f"internal error: {type(e).__name__}: {e}"
        if s.changing:  # the state may be half-updated: fail rather than serve from it
            self.replies.fail(f"{text} (while applying {msg.op!r} of worker {who})")
        if not s.current_answered:  # every request gets exactly one reply
            self.replies.error(ident, msg.op, text)

    def on_done(self, ident: bytes, msg: wire.Message) -> None:
        s = self.state
        s.done.add(s.sender(msg))
        self.replies.send(ident, "done", {"op": "ack", "version": s.version})
        self._exit_if_over()

    def _exit_if_over(self) -> None:
        if self.state.exit_when_done and self.state.done >= self.state.live:
            self.state.stopping = True
            self.readmit.refuse_all("every other worker is done")

    def lose(self, w: int, why: str) -> None:
        """Go on without worker w: refuse its waiting pulls as a lost worker's (so that it rejoins at once, or
        leaves), drop its rows of the round, finish what waited for it. A lost worker whose process died is never
        taken back (its held rejoins are refused)."""
        s = self.state
        if w in s.lost:
            if why == LOST_BY_LAUNCHER:
                self.readmit.died(w)
            return
        if self.rows is not None:
            self.rows.drop(w)
        s.lost.add(w)
        self.readmit.dropped(w, why == LOST_BY_LAUNCHER)
        for k, p in list(s.pending.items()):
            if p.worker == w:
                del s.pending[k]
                self.replies.error(p.ident, p.op, f"worker {w} was declared lost", WorkerLost.code, s.version)
        if s.exit_when_done or why != LOST_BY_LAUNCHER:   # the launcher says why itself
            print(f"psarch server {s.index}: worker {w} lost: {why}", file=sys.stderr, flush=True)
        if s.initialised and s.failure is None:
            for part in s.parts:
                self.pushes.complete_round(part)
            self.pulls.serve()
            self.snapshots.save_if_all()
            self.readmit.serve()
        self._exit_if_over()

    def inflight_budget(self) -> int:
        """Bytes one connection may have in flight each way (connections.py): backend.inflight_mb, or twice the
        largest exchange of a worker with this server, every partition of its range in flight
        (tcp_bytes.exchange_budget); 2 GiB while a server started without parameters waits for `init`."""
        b, s = self.state.cfg.backend, self.state
        if b.inflight_mb:
            return int(b.inflight_mb * 2**20)
        if not s.initialised:
            return 2 * 2**30
        rows = self.rows.most_bytes() if self.rows is not None else 0
        return exchange_budget(s.size, len(s.parts), rows, wire.MAX_HEADER)

    # ------------------------------------------------------------------ clocks and the launcher

    def check_deadlines(self) -> None:
        """Lose silent workers (standalone), fail on an overdue save, round or pull (deadlines.py)."""
        s = self.state
        if s.failed_at is not None and s.exit_when_done and time.monotonic() - s.failed_at > 10:
            s.stopping = True  # standalone: the workers have had time to hear the error
        if s.failure is not None or s.stopping:
            return
        now = time.monotonic()
        # first: a silent worker is a lost one, so the waits below blame no one for a worker that died
        for w, why in self.deadlines.silent(now) + self.deadlines.overdue(now):
            self.lose(w, why)
        if s.stopping or self.snapshots.overdue(now):
            return
        self.deadlines.check_waits(now)

    def command(self, cmd: Command) -> None:
        """A command on the launcher's pipe: `lost` (a worker's process died), `stats`, `stop`."""
        if cmd.get("cmd") == "lost":
            self.lose(int(cmd["worker"]), LOST_BY_LAUNCHER)
        elif cmd.get("cmd") == "stats":
            self.replies.notify({"event": "stats", **server_stats(self)})
            self.replies.payload(final_params(self))
        elif cmd.get("cmd") == "stop":
            self.state.stopping = True
