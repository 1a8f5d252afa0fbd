"""Requests a worker sent again, applied once (ps-lite's resender: PS_RESEND). A worker numbers its requests to each
server (`rid`) and sends a request again, under the same id, where its reply has not come: its connection dropped
and came back, or `backend.resend_timeout_s` passed (psarch/ps/worker/resend.py). So a server may be handed one
request twice, or more: its first copy may have been applied with its reply lost on the way, or still wait (a pull
in a round in progress), or never have arrived. A server keeps, per worker, each recent request's id and what
became of it (`Entry`), and answers a repeat without applying it again:

- still waiting (a pull, a save, a rejoin, a row pull held for its round): its one reply goes, when it comes, to
  the connection the repeat came on (`Return.route`; the first one's has closed, or will not be read);
- `fetch`, `rowpull`, `rowfetch` (they change nothing): handled again;
- answered: the same reply again, from the entry. A reply that carried the parameters carries them as they are
  now: in the barrier modes they cannot have moved (the round after needs this worker's next push), so the bits
  are the first reply's; elsewhere they may be newer than the version the reply names, the one the server's
  records say the worker holds (a worker's staleness may then be counted short, on a repeat only). Nothing a
  repeat does changes what the server records of the worker, so a repeat whose first reply did arrive after all
  (the worker drops the second: every reply names the id it answers) leaves no trace. A lost worker's repeated
  pull is refused, as its first copy would be now. A GEO delta moved the server's copy of what the worker
  holds: it is kept and sent again (as are GEO's start-up parameters, where deltas follow).

A sync round so never counts one worker's push twice.

Memory. Ids are a session (drawn at random per client and server: SESSION_BITS up) and a count, so a worker's new
client is told from its old one (SESSIONS kept per worker). A session forgotten (SESSIONS newer ones of its worker
came since) is remembered by its id (the newest RETIRED per worker): a request of it (a copy read late off a dead
client's connection, or a superseded client's) is refused, as the server cannot tell whether it was applied, never
taken for a new client's and handled again (a pull would move what the server records the worker holds). Only a
session older than RETIRED + SESSIONS clients of its worker would go unrecognised. A worker has at most one request per partition in
flight to a server each way (a priority push and its pull: two), and a few more (rows, commits, a save), so a server
keeps LIMIT + 2 x its partitions entries per worker, and past twice that forgets the oldest answered ones, down to
that. Each holds the request's and the reply's headers; a GEO reply's tensor is dropped at that partition's next
request from the worker (sent only once it has the reply). An id older than every entry kept (none is, from a worker
whose requests in flight stay under that bound) is refused: the server cannot tell whether it was applied. A
request that names no id (another client) is never taken for a repeat.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from psarch.ps import wire
from psarch.ps.errors import PSError
from psarch.ps.messages import SESSION_BITS
from psarch.ps.server.state import ServerState

if TYPE_CHECKING:   # (they send through a Return: replies.py imports this module)
    from psarch.ps.server.pulls import PullQueue
    from psarch.ps.server.replies import Replies

LIMIT = 32          # entries kept per worker beyond 2 per partition
SESSIONS = 2        # sessions kept per worker: its client's, and one that connected beside it or before it
RETIRED = 32        # sessions forgotten per worker whose requests are still recognised (and refused)
CONNECTIONS = 4     # connections remembered per worker (which is newer), SESSIONS and more
READS = ("fetch", "rowpull", "rowfetch")   # change nothing: handled again


class Return(bytes):
    """A request's return address: the routing id of the connection it came on (the bytes), the id its worker gave
    it (`rid`), the routing id its reply goes to (`route`: a repeat's connection, once one came) and its `entry`."""

    rid: int
    route: bytes
    entry: "Entry"


@dataclass(eq=False, slots=True)
class Session:
    """One client's requests of a worker (their ids' high bits name it), by id in arrival order; the newest id
    forgotten; the entries keeping a tensor, by partition offset."""

    entries: dict[int, "Entry"] = field(default_factory=dict)
    floor: int = -1
    kept: dict[int, "Entry"] = field(default_factory=dict)
    trim_at: int = 0   # the entries past which the oldest answered are next forgotten


@dataclass(eq=False, slots=True)
class Entry:
    """One request of a worker, by its id: where its reply goes, and once answered, the reply."""

    ret: Return
    op: str                               # the request's op
    session: Session
    booked: str = ""                      # the reply's traffic name, header and tensors, once answered
    header: dict[str, Any] | None = None
    tensor: torch.Tensor | None = None    # GEO with compression: kept for a repeat
    keys: torch.Tensor | None = None

    def answered(self, booked: str, header: dict[str, Any], tensor: torch.Tensor | None,
                 keys: torch.Tensor | None, geo: bool) -> None:
        """Its reply is sent (or was to be: a dropped connection's); `geo` (GEO with compression): its tensors are
        kept until the worker's next request of that partition (a delta moved the server's copy of what the worker
        holds, and the start-up parameters set it)."""
        self.booked, self.header = booked, header
        if geo and tensor is not None and self.op not in READS:
            self.tensor, self.keys = tensor, keys
            self.session.kept[header["offset"]] = self   # (delta and params replies name their partition)


def returned(ident: bytes, rid: int, entry: Entry | None = None) -> Return:
    """The return address of request `rid` that came on connection `ident` (of `entry`: a repeat's)."""
    r = Return(ident)
    r.rid, r.route = rid, ident
    if entry is not None:
        r.entry = entry
    return r


class Repeats:
    """Each worker's recent requests by id (`arrived`), and the repeats answered without applying them again."""

    def __init__(self, state: ServerState, replies: Replies, pulls: PullQueue) -> None:
        self.state, self.replies, self.pulls = state, replies, pulls
        self.sessions: list[dict[int, Session]] = [{} for _ in range(state.workers)]   # per worker, by session
        self.retired: list[dict[int, None]] = [{} for _ in range(state.workers)]   # per worker, oldest first
        self.repeats = 0   # repeats answered without being applied again
        # each worker's latest connections, numbered as each first brought a request: a copy late off a connection
        # since dropped (read after its repeat on the new one) must not take the reply back to it
        self.seen: list[dict[bytes, int]] = [{} for _ in range(state.workers)]
        self.count = 0

    def arrived(self, ident: bytes, msg: wire.Message) -> bytes | None:
        """Request `msg` (which names an id) came on `ident`: the address to handle it with (its Return), or None
        where it is a repeat answered (or re-routed) here. A repeat that is handled again (a read, a lost worker's
        pull: refused) gets a Return too; a request of no worker of this run, `ident` (the handler refuses it)."""
        w, rid = msg.header.get("worker"), msg.header["rid"]
        if not isinstance(w, int) or not 0 <= w < len(self.sessions):
            return ident   # (a reply op names no worker)
        seen = self.seen[w]
        if ident not in seen:
            self.count += 1
            seen[ident] = self.count
            if len(seen) > CONNECTIONS:
                del seen[next(iter(seen))]
        sessions = self.sessions[w]
        sid = rid >> SESSION_BITS
        kept = sessions.get(sid)
        if kept is None:
            retired = self.retired[w]
            if sid in retired:
                raise PSError(f"{msg.op}: worker {w}'s request {rid} is of a client session this server has "
                              f"forgotten ({SESSIONS} newer ones came since): it cannot tell whether it was applied")
            kept = sessions[sid] = Session()
            if len(sessions) > SESSIONS:
                gone = next(iter(sessions))
                del sessions[gone]
                retired[gone] = None
                if len(retired) > RETIRED:
                    del retired[next(iter(retired))]
        entry = kept.entries.get(rid)
        if entry is None:
            if rid <= kept.floor:
                raise PSError(f"{msg.op}: worker {w}'s request {rid} is older than the {len(kept.entries)} this "
                              f"server keeps: it cannot tell whether it was applied")
            return self._new(kept, rid, ident, msg)
        self.repeats += 1
        if entry.header is None:   # still waiting: answered on the newer of its connections
            if seen[ident] > seen.get(entry.ret.route, 0):
                entry.ret.route = ident
            return None
        ret, said = returned(ident, rid, entry), entry.header
        tensor = entry.tensor
        if msg.op in READS:
            return ret
        if said["op"] == "params" and tensor is None:
            if w in self.state.lost or self.state.failure is not None:
                return ret   # refused, as a first copy would be now
            tensor = self.pulls.params(self.state.part_at(said["offset"], msg.op))
        self.replies.send(ret, entry.booked, dict(said), tensor, entry.keys)
        return None

    def _new(self, kept: Session, rid: int, ident: bytes, msg: wire.Message) -> Return:
        """A request this server has not seen: its entry, the oldest answered ones past the bound forgotten."""
        entry = Entry(returned(ident, rid), msg.op, kept)
        entry.ret.entry = entry
        kept.entries[rid] = entry
        if kept.kept and "offset" in msg.header:   # the worker has the partition's last reply: it asks only after
            old = kept.kept.pop(msg.header["offset"], None)
            if old is not None:
                old.tensor = old.keys = None
        bound = LIMIT + 2 * len(self.state.parts)
        if len(kept.entries) > max(2 * bound, kept.trim_at):   # down to the newest `bound` (and any still waiting)
            answered = [r for r, e in kept.entries.items() if e.header is not None]
            for old_rid in answered[:len(kept.entries) - bound]:
                del kept.entries[old_rid]
                kept.floor = max(kept.floor, old_rid)
            kept.trim_at = len(kept.entries) + bound   # (those still waiting are not walked at every request)
        return entry.ret
