"""The worker's side of the wire: one DEALER per server; requests go to every server before any reply
is awaited, so pushes (and pulls) to all servers travel in parallel. Every frame is counted.

`post` sends a request at once and `wait` collects replies, so a worker may send while it computes (pushes
from backward's hooks) and take the replies later. A server answers a connection's requests in the order
their partitions become ready, not always in the order they were sent: a reply goes to the request whose id it
names. A request unanswered when its connection comes back, or after backend.resend_timeout_s, is sent again under
its id (resend.py; the server applies it once)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from psarch.meters import TrafficMeter
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from psarch.ps.errors import NonFinitePush, PSError, RejoinLate, WorkerLost
from psarch.ps.worker.resend import Connection, Waiting, session
from psarch.timeline import RECORDER
from psarch.units import fmt_bytes

# what a connection's monitor says that may lose a request (ZeroMQ resends nothing), as the timeout's line says it;
# a handshake that succeeds after one brings the connection back (resend.py)
_LOSSES = {int(zmq.EVENT_DISCONNECTED): "dropped",
           int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "handshake refused by the server",
           int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "handshake failed",
           int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "handshake failed"}


@dataclass
class Request:
    """One request to one server; a `params` or `rows` reply is decoded straight into `into` when given
    (else into a new tensor, left in `into`). `keys`: the int64 keys of a keyed request (rowpush)."""

    header: dict[str, Any]
    tensor: torch.Tensor | None = None
    into: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    reply: dict[str, Any] = field(default_factory=dict)
    reply_keys: torch.Tensor | None = None   # the int64 keys a keyed reply carried (sparsedelta)
    answered: bool = False
    posted_s: float | None = None   # when it was sent (perf_counter), in a traced step (psarch.timeline)
    rid: int = -1                   # its id to its server (resend.py), and when it was last sent (monotonic)
    sent_s: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor it carries (0 for none)."""
        return self.tensor.numel() * self.tensor.element_size() if self.tensor is not None else 0

    @property
    def received(self) -> torch.Tensor:
        """The tensor its reply carried (once answered)."""
        if self.into is None:
            raise PSError(f"{self.header['op']}: its reply carried no tensor")
        return self.into

    @property
    def key(self) -> tuple[str, int | None]:
        """What its reply names: the reply op and, for a partition's reply, the offset the request named (if any)."""
        op = wire.REPLY_TO[self.header["op"]]
        return op, self.header.get("offset") if op in wire.PARTITION_REPLIES else None


class PSClient:
    """A worker's connections to the servers (addresses like 'tcp://127.0.0.1:5555')."""

    def __init__(self, addresses: Sequence[str], worker: int, timeout_s: float,
                 creds: Credentials | dict | None = None, heartbeat_s: float = 10.0,
                 heartbeat_timeout_s: float = 30.0, failover: bool = False, resend_s: float = 0.0) -> None:
        """creds: how to authenticate (a Credentials or its dict; None: no auth, loopback servers only); failover:
        a server whose connection drops is dead (backend.replicas: its partitions live on elsewhere, ServerLink).
        With failover the sockets send no heartbeats: a connection then drops only where the server's process died
        (the kernel closes its TCP connection), never for a server that is merely stopped (SIGSTOP) or slow, which
        is waited for like any other, up to timeout_s. resend_s: a request unanswered this long is sent again
        (0: only when its connection comes back; never with failover: resend.py)."""
        creds = creds if isinstance(creds, Credentials) else Credentials.from_dict(creds)
        self.addresses = list(addresses)
        self.worker = worker
        self.timeout_s = timeout_s
        self.meter = TrafficMeter()
        self.zctx = zmq.Context()
        self.socks = []
        for i, addr in enumerate(self.addresses):
            s = self.zctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            auth.bound(s, 0.0 if failover else heartbeat_s, heartbeat_timeout_s)
            auth.client_socket(s, creds, worker, i)
            s.connect(addr)
            self.socks.append(s)
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)
        self.waiting = [Waiting() for _ in self.socks]   # sent, not yet answered, per server
        self.rids = [session() for _ in self.socks]      # each server's next request id
        self.resend_s = 0.0 if failover else resend_s   # 0: only on reconnection
        self.check_at = 0.0   # when requests waiting longer than resend_s are next looked for
        self.dead: dict[int, float] = {}   # failover: each dead server and when its connection dropped (time.time())
        # failover: a connection that drops (its server's process died: the kernel closed its socket) is an event here;
        # else each connection's drops and refused handshakes are counted (named where a reply never comes), and what
        # it carried is sent again once it is back (ZeroMQ resends nothing, and never retries a refused handshake)
        self.failover = failover
        watched = (zmq.EVENT_DISCONNECTED if failover else   # (distinct bits: their sum is their union)
                   sum(_LOSSES) + zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.monitors = [s.get_monitor_socket(watched) for s in self.socks]
        self.connections = [Connection() for _ in self.socks]
        for m in self.monitors:
            self.poller.register(m, zmq.POLLIN)

    def exchange(self, requests: Sequence[Sequence[Request]], timeout_s: float | None = None) -> None:
        """Send requests[i] to server i (all servers first), then wait for every reply. Replies land in
        each Request's `reply` (header) and `into` (payload). Raises PSError on an error reply or when a
        server does not answer within the timeout."""
        for i, reqs in enumerate(requests):
            for r in reqs:
                self.post(i, r)
        self.wait(timeout_s)

    def post(self, i: int, r: Request) -> None:
        """Send request `r` to server i now; its reply is taken by a later `wait` (never, to a dead server)."""
        if i in self.dead:
            return
        r.rid, self.rids[i] = self.rids[i], self.rids[i] + 1
        r.posted_s = time.perf_counter() if RECORDER.on else None
        self._send(i, r, r.header["op"])
        self.waiting[i].add(r)

    def _send(self, i: int, r: Request, booked: str) -> None:
        frames = wire.encode(dict(r.header, worker=self.worker, rid=r.rid), r.tensor, r.keys)
        self.meter.add(booked, wire.frames_bytes(frames), 0)
        r.sent_s = time.monotonic()
        self.socks[i].send_multipart(frames, copy=False)

    def _resend(self, i: int, due: float | None = None) -> None:
        """Send server i's waiting requests again, under their ids (those last sent before `due`, when given)."""
        for r in list(self.waiting[i].by_rid.values()):
            if due is None or r.sent_s <= due:
                self._send(i, r, "resend")
                self.connections[i].resent += 1

    def wait(self, timeout_s: float | None = None, until: Request | None = None, once: bool = False) -> None:
        """Take replies until every posted request is answered (or `until` is; with `once`, until any reply is
        taken)."""
        limit = self.timeout_s + 5.0 if timeout_s is None else timeout_s  # a server's own timeout fires first
        deadline = time.monotonic() + limit
        while any(self.waiting) and (until is None or not until.answered):
            now = time.monotonic()
            if self.resend_s and now >= self.check_at:
                self._resend_overdue(now)
            until_s = min(deadline, self.check_at) if self.resend_s else deadline
            events = dict(self.poller.poll(max(0, int((until_s - now) * 1000))))
            if not events and time.monotonic() >= deadline:
                names = ", ".join(f"server {i} ({self.addresses[i]}){self.connections[i].said()}"
                                  for i, w in enumerate(self.waiting) if w)
                raise PSError(f"worker {self.worker}: no reply from {names} within {limit:g} s")
            self._drain(events)
            if once and events:
                return

    def _resend_overdue(self, now: float) -> None:
        """Send again what has waited resend_s since it was last sent, on each connection not known to be down."""
        self.check_at = now + self.resend_s / 4
        for i, c in enumerate(self.connections):
            if self.waiting[i] and not c.down and i not in self.dead:
                self._resend(i, due=now - self.resend_s)

    def take_arrived(self) -> None:
        """Take the replies already here, waiting for none (priority's pushes, between backward's hooks)."""
        if any(self.waiting):
            self._drain(dict(self.poller.poll(0)))

    def _drain(self, events: dict) -> None:
        for i, sock in enumerate(self.socks):
            while self.waiting[i] and sock in events and auth.readable(sock):   # drain what has arrived
                self._receive(i, sock.recv_multipart(copy=False))
        for i, m in enumerate(self.monitors):
            if m not in events:
                continue
            if not self.failover:
                while m.poll(0):
                    event = int(recv_monitor_message(m)["event"])
                    if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        self.connections[i].lost(_LOSSES[event])
                    elif self.connections[i].came_back():
                        self._resend(i)
            elif i not in self.dead:   # what it answered before it died is taken above
                recv_monitor_message(m)
                self._bury(i)

    def _bury(self, i: int) -> None:
        """Server i died: never wait for it or send to it again, and close its socket (no reconnecting to it)."""
        self.dead[i] = time.time()
        self.waiting[i] = Waiting()   # never answered: its partitions' other holders answer them
        sock, m = self.socks[i], self.monitors[i]
        self.poller.unregister(sock)
        self.poller.unregister(m)
        sock.disable_monitor()
        m.close(linger=0)
        sock.close(linger=0)

    def _receive(self, i: int, frames: list) -> None:
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            op = self.waiting[i].oldest().header["op"]
            self.meter.add(op, 0, wire.frames_bytes(frames), calls=0)
            raise PSError(f"worker {self.worker}: bad reply from server {i} to {op!r}: {e}") from None
        req = self.waiting[i].take(msg)
        if req is None and "rid" in msg.header:   # a request answered already: the reply to its repeat, or the first
            self.meter.add("resend", 0, wire.frames_bytes(frames), calls=0)
            return
        if req is None:
            op = self.waiting[i].oldest().header["op"]
            raise PSError(f"worker {self.worker}: server {i} answered {op!r} with {msg.op!r}"
                          + (f" for offset {msg.header['offset']}" if "offset" in msg.header else ""))
        op = req.header["op"]
        self.meter.add(op, 0, wire.frames_bytes(frames), calls=0)
        if msg.op == "error":
            text, code = f"{op} refused by {msg.header['message']}", msg.header.get("code")
            if code in (WorkerLost.code, RejoinLate.code):   # the server's version, for a sync worker's rejoin
                raise (WorkerLost if code == WorkerLost.code else RejoinLate)(text, msg.header.get("version", 0))
            raise (NonFinitePush if code == NonFinitePush.code else PSError)(text)
        req.answered = True
        if req.posted_s is not None:   # a traced step: sent until its reply was taken, on the connection's lane
            RECORDER.add(f"to server {i}", f"{op} {fmt_bytes(req.nbytes)}" if req.nbytes else op, req.posted_s,
                         time.perf_counter())
        if msg.op in ("params", "rows", "delta", "sparsedelta"):
            try:   # a payload of another size than the destination's (a rows reply to a rowpull names no keys)
                req.into = msg.tensor(req.into)
                req.reply_keys = msg.keys() if msg.op == "sparsedelta" else None
            except wire.WireError as e:
                raise PSError(f"worker {self.worker}: bad reply from server {i} to {op!r}: {e}") from None
        req.reply = msg.header

    def close(self) -> None:
        for m, s in zip(self.monitors, self.socks):
            if not m.closed:
                s.disable_monitor()
                m.close(linger=0)
        for s in self.socks:
            s.close(linger=0)   # closing twice does nothing
        self.zctx.term()
