"""The worker's side of the wire: one DEALER per server; requests go to every server before any reply
is awaited, so pushes (and pulls) to all servers travel in parallel. Every frame is counted."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import zmq

from psarch.meters import TrafficMeter
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from psarch.ps.errors import NonFinitePush, PSError

@dataclass
class Request:
    """One request to one server; a `params` or `rows` reply is decoded straight into `into` when given
    (else into a new tensor, left in `into`). `keys`: the int64 keys of a keyed request (rowpush)."""

    header: dict[str, Any]
    tensor: torch.Tensor | None = None
    into: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    reply: dict[str, Any] = field(default_factory=dict)


class PSClient:
    """A worker's connections to the servers (addresses like 'tcp://127.0.0.1:5555')."""

    def __init__(self, addresses: Sequence[str], worker: int, timeout_s: float,
                 creds: Credentials | dict | None = None, heartbeat_s: float = 10.0,
                 heartbeat_timeout_s: float = 30.0) -> None:
        """creds: how to authenticate (a Credentials or its dict; None: no auth, loopback servers only)."""
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
            auth.bound(s, heartbeat_s, heartbeat_timeout_s)
            auth.client_socket(s, creds, worker, i)
            s.connect(addr)
            self.socks.append(s)
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)

    def exchange(self, requests: Sequence[Sequence[Request]], timeout_s: float | None = None) -> None:
        """Send requests[i] to server i (all servers first), then wait for every reply. Replies land in
        each Request's `reply` (header) and `into` (payload). Raises PSError on an error reply or when a
        server does not answer within the timeout."""
        for i, reqs in enumerate(requests):
            for r in reqs:
                frames = wire.encode(dict(r.header, worker=self.worker), r.tensor, r.keys)
                self.meter.add(r.header["op"], wire.frames_bytes(frames), 0)
                self.socks[i].send_multipart(frames, copy=False)
        left = {i: list(reqs) for i, reqs in enumerate(requests) if reqs}
        limit = self.timeout_s + 5.0 if timeout_s is None else timeout_s  # a server's own timeout fires first
        deadline = time.monotonic() + limit
        while left:
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(self.poller.poll(wait_ms))
            if not events and time.monotonic() >= deadline:
                names = ", ".join(f"server {i} ({self.addresses[i]})" for i in left)
                raise PSError(f"worker {self.worker}: no reply from {names} within {limit:g} s")
            for i in list(left):
                sock = self.socks[i]
                # drain what has arrived (asking EVENTS is much cheaper than a NOBLOCK recv raising Again)
                while i in left and sock in events and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._receive(i, left[i].pop(0), sock.recv_multipart(copy=False))
                    if not left[i]:
                        del left[i]

    def _receive(self, i: int, req: Request, frames: list) -> None:
        op = req.header["op"]
        self.meter.add(op, 0, wire.frames_bytes(frames), calls=0)
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            raise PSError(f"worker {self.worker}: bad reply from server {i} to {op!r}: {e}") from None
        if msg.op == "error":
            kind = NonFinitePush if msg.header.get("code") == NonFinitePush.code else PSError
            raise kind(f"{op} refused by {msg.header['message']}")
        if msg.op != wire.REPLY_TO[op]:
            raise PSError(f"worker {self.worker}: server {i} answered {op!r} with {msg.op!r}")
        if msg.op in ("params", "rows"):
            try:   # a payload of another size than the destination's (a rows reply to a rowpull names no keys)
                req.into = msg.tensor(req.into)
            except wire.WireError as e:
                raise PSError(f"worker {self.worker}: bad reply from server {i} to {op!r}: {e}") from None
        req.reply = msg.header

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.zctx.term()
