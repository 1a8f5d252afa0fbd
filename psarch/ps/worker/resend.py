"""A worker's requests in flight to one server, by id, and what its connection went through: what the worker sends
again (ps-lite's resender, PS_RESEND).

ZeroMQ resends nothing a dropped connection carried: a request on a connection that a server's watchdog cut (over
backend.inflight_mb), that a heartbeat expired or that TCP reset is lost with it, or its reply is. So every request
names an id (`rid`: a session drawn at random per client and server, SESSION_BITS up, then a counter), and a worker
sends again, under the same id, every request still unanswered
- when its connection comes back (ZeroMQ's monitor: a handshake succeeded after a drop), and
- when one has waited `backend.resend_timeout_s` (0, the default: never; a timeout, so dilation stretches it
  like every other: psarch/cluster/dilation.py's `stretched`), at most once per that interval; a connection known
  to be down is left to its reconnection.
The server applies a request once, however many times it comes (psarch/ps/server/repeats.py), and every reply
names the id it answers: a reply to a request already answered (a repeat's, where the first was not lost after all)
is dropped. Nothing changes on the fast path but one header field each way: no message more, no copy (a request
keeps its tensor, and is encoded again only to be sent again). Repeats and the replies dropped are booked as
`resend` in the worker's traffic. With replicas (failover) nothing is sent again: a dead server's partitions are
served by their other holders, which have every push already.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from psarch.ps import wire
from psarch.ps.messages import SESSION_BITS

if TYPE_CHECKING:
    from psarch.ps.worker.client import Request


def session() -> int:
    """A new client's first request id to one server: a random session (29 bits: ids stay within the wire's
    integers), then 0."""
    return (int.from_bytes(os.urandom(4), "little") >> 3 | 1) << SESSION_BITS


class Waiting:
    """The requests sent to one server and not yet answered, by id, in the order sent."""

    def __init__(self) -> None:
        self.by_rid: dict[int, Request] = {}

    def __len__(self) -> int:
        return len(self.by_rid)

    def add(self, r: Request) -> None:
        self.by_rid[r.rid] = r

    def oldest(self) -> Request:
        return next(iter(self.by_rid.values()))

    def take(self, msg: wire.Message) -> Request | None:
        """The request reply `msg` answers, removed: the one of the id it names (None: none waits, it was answered
        already). A reply naming no id (a server's error for a message it could not read) takes the oldest request
        it may answer: of the same reply op and, for a partition's reply, offset; the oldest of any for an error."""
        rid = msg.header.get("rid")
        if rid is not None:
            return self.by_rid.pop(rid, None)
        want = (msg.op, msg.header.get("offset") if msg.op in wire.PARTITION_REPLIES else None)
        for rid, r in self.by_rid.items():
            if msg.op == "error" or r.key in (want, (msg.op, None)):
                del self.by_rid[rid]
                return r
        return None


@dataclass
class Connection:
    """What one server's connection went through (its monitor's events), and the requests sent on it again."""

    losses: Counter[str] = field(default_factory=Counter)   # drops and refused handshakes, by what the line says
    down: bool = False     # lost and not back since
    back: int = 0          # times it came back after a drop
    resent: int = 0        # requests sent again

    def lost(self, why: str) -> None:
        self.losses[why] += 1
        self.down = True

    def came_back(self) -> bool:
        """A handshake succeeded: whether it follows a drop (then what waits on it is sent again)."""
        was, self.down = self.down, False
        self.back += was
        return was

    def said(self) -> str:
        """What the timeout's line says of it ("" for nothing that may have lost a request)."""
        if not self.losses and not self.resent:
            return ""
        parts = [", ".join(f"{why} {n} x" for why, n in self.losses.items())] if self.losses else []
        if self.down:
            parts.append("not back since: what it carried could not be sent again")
        elif self.back:
            parts.append(f"back {self.back} x")
        if self.resent:
            parts.append(f"{self.resent} request(s) sent again")
        return f" [its connection: {'; '.join(parts)}]"
