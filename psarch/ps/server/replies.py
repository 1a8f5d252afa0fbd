"""What a server says: replies on its ROUTER socket (every frame counted) and events on the launcher's pipe.

Every request gets exactly one reply, in order: `ack`, `params`, `rows` or `error` (unless its connection is
dropped for leaving too many unread: connections.py; the worker then sends it again, and its repeat is answered
without being applied again: repeats.py). A failed server answers
every waiting pull with its failure and tells the launcher (event `failed`); the pipe carries JSON, never pickle.
"""
from __future__ import annotations

import json
import time
from typing import Any

import torch
import zmq

from psarch.meters import TrafficMeter
from psarch.ps import wire
from psarch.ps.server.connections import Connections
from psarch.ps.server.repeats import Return
from psarch.ps.server.state import ServerState


class Replies:
    """The server's outgoing side: `send` and `error` answer a request, `fail` fails the server, `notify`
    writes an event on the launcher's pipe (None: a server without launcher)."""

    def __init__(self, sock: zmq.Socket, meter: TrafficMeter, state: ServerState, pipe: Any,
                 connections: Connections | None = None) -> None:
        """connections: what each connection has in flight (None: unbounded)."""
        self.sock, self.meter, self.state, self.pipe, self.connections = sock, meter, state, pipe, connections

    def send(self, ident: bytes, op: str, header: dict[str, Any], tensor: torch.Tensor | None = None,
             keys: torch.Tensor | None = None) -> None:
        """Answer request `op` of connection `ident` (a keyed reply: `keys` before the tensor); unless its unread
        replies would go over its budget: then its connection is dropped instead (connections.py)."""
        if type(ident) is Return:   # a request that named its id: the reply names it, and is kept for a repeat
            header["rid"] = ident.rid
            ident.entry.answered(op, header, tensor, keys, self.state.pulls_deltas)
            if ident == self.state.current:
                self.state.current_answered = True
            ident = ident.route   # where a repeat came from, once one did (repeats.py)
        elif ident == self.state.current:
            self.state.current_answered = True
        frames = wire.encode(header, tensor, keys)
        size = wire.frames_bytes(frames)
        if self.connections is not None and not self.connections.may_send(ident, size):
            return
        self.meter.add(op, size, 0, calls=0)
        self.sock.send_multipart([ident, *frames], copy=False)

    def error(self, ident: bytes, op: str, text: str, code: str | None = None, version: int | None = None) -> None:
        """Refuse request `op` (counted as rejected unless the server has failed); `code` names the kind, `version`
        the server's (a dropped worker's request)."""
        self.state.rejected += self.state.failure is None
        header: dict[str, Any] = {"op": "error", "message": f"server {self.state.index}: {text}"[:4000]}
        if code:
            header["code"] = code
        if version is not None:
            header["version"] = version
        self.send(ident, op, header)

    def fail(self, text: str) -> None:
        """The server can no longer serve: every waiting and later request hears `text`, and so does the launcher."""
        s = self.state
        s.failure = text
        s.failed_at = time.monotonic()
        for p in list(s.pending.values()):
            self.error(p.ident, p.op, text)
        s.pending = {}
        self.notify({"event": "failed", "server": s.index, "message": f"server {s.index}: {text}"})

    def notify(self, event: dict[str, Any]) -> None:
        if self.pipe is not None:
            self.pipe.send_bytes(json.dumps(event).encode())

    def payload(self, data: bytes | memoryview) -> None:
        """Raw bytes on the launcher's pipe (the final parameters after a `stats` event)."""
        self.pipe.send_bytes(data)
