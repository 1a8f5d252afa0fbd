"""Every connection a server holds, who it is, and what each may make the server hold: the bound on one peer.

ZeroMQ hands the server a message only once its last frame has arrived, and queues the replies a peer has not
read; no socket option bounds either (ZMQ_MAXMSGSIZE caps one frame; the high-water marks count messages, and a
message may have any number of frames). So the server counts, per TCP connection (the descriptor ZeroMQ's
monitor names when it accepts one, and that every message names, ZMQ_SRCFD):

- in flight in: bytes the kernel received on it (TCP_INFO) - the bytes of the messages the server was handed,
  each frame with its exact ZMTP framing (`framing`) - what may be handshake and heartbeats: at most HANDSHAKE
  plus 2 x HEARTBEAT bytes a heartbeat interval, counted only since the last time nothing else could be in
  flight (`Connection.floor`), so no credit builds up over a connection's life;
- in flight out: bytes of the replies the server sent on it - bytes the peer acknowledged (TCP_INFO).

Over `budget` either way, the connection is shut down (ZeroMQ then frees its unfinished message and its queued
replies, and the heap gives the pages back to the system). A watchdog thread checks the inbound side every
PERIOD_S; a reply that would take the outbound side over budget is not sent. ZeroMQ keeps each frame of a
message in at least FRAME_COST bytes (and, unless told to copy frames out, a frame of more than 33 bytes as a
reference into the 8 KiB buffer it was read into: `copy_received_frames`; both in psarch/ps/server/tcp_bytes.py),
so what one connection can make the server hold is at most

    FRAME_COST / (smallest frame on the wire) x (budget + what its link delivers in PERIOD_S) + budget

the first term for a message of empty frames (2 bytes each without CURVE: 32 x; 35 with CURVE: under 2 x).

Who a connection is: the worker its first message proves (ZAP's User-Id, ZMQ's metadata on every frame).
Before that it is pending: in its handshake, refused by it (libzmq closes those after handshake_timeout_s), or
authenticated and silent. Pending connections fill their own cap (`max_pending`): past it the oldest
older than handshake_timeout_s is dropped (a younger one may be a worker whose first request is on its way), so
strangers never hold a slot a worker needs. An authenticated handshake takes a slot of the
server's cap (`max_connections`) and of its worker's (`per_worker`) from ZAP's answer until its first message
proves it (or handshake_timeout_s passes), then as long as the connection is open; a first message that would
take its worker or the server past a cap (a connection silent past handshake_timeout_s, whose slot lapsed)
drops its connection unanswered.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from psarch.ps.server.libc import release_freed_memory
from psarch.ps.server.tcp_bytes import HANDSHAKE, HEARTBEAT, framing, shut, tcp_counters

PERIOD_S = 0.01
GONE = 4096           # routing ids of closed connections remembered
# why a connection was shut down, as its worker's line says it (`dropped` counts them by these keys)
WHY = {"unread": "replies not read past the in-flight budget (backend.inflight_mb)",
       "inflight": "a message unfinished past the in-flight budget (backend.inflight_mb)",
       "frames": "a message of too many frames", "over_cap": "past a connection cap"}   # (pending ones: no worker)
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _FAILED


@dataclass
class Connection:
    """What the server knows of one TCP connection."""

    since: float
    framed: int = 0        # bytes of the messages handed to the server, with their framing
    sent: int = 0          # bytes of the replies the server gave ZeroMQ for it
    received: int = 0      # the kernel's counters when last read
    acked: int = 0
    floor: float = HANDSHAKE   # most of (received - framed) that may be handshake and heartbeats, not messages
    checked: float = 0.0   # when `floor` was last raised
    user: str | None = None    # the worker its first message proved it is (None: pending)
    dropped: bool = False  # shut down by the server (ZeroMQ has not said it closed yet)
    accepted: bool = False  # the monitor's ACCEPTED seen (a first message may come first: the monitor lags)

    def __post_init__(self) -> None:
        self.checked = self.since


@dataclass(frozen=True)
class Caps:
    """How many connections a server admits: past their handshake (`total`), of one worker (`per_worker`;
    not for auth "none", where no connection proves who it is), and pending (`pending`); and how long an
    authenticated connection may keep its slot before its first message (`prove_s`)."""

    total: int
    per_worker: int
    pending: int
    prove_s: float


class Connections:
    """The connections of one ROUTER, who each is, what each has in flight, and a watchdog that drops those over
    `budget` (a function: the budget follows what the server holds) and the oldest pending ones past the cap.
    `dropped` counts drops by reason."""

    def __init__(self, sock: zmq.Socket, budget: Callable[[], int], heartbeat_s: float, caps: Caps,
                 curve: bool = False, name: str = "server") -> None:
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.budget, self.heartbeat_s, self.caps, self.curve = budget, heartbeat_s, caps, curve
        self.conns: dict[int, Connection] = {}
        self.fds: dict[bytes, int] = {}          # routing id -> descriptor, from the messages
        # routing ids of closed connections: ZeroMQ still hands over what they sent, and drops what they are sent
        self.gone: dict[bytes, None] = {}
        self.admitted: dict[str, list[float]] = {}   # worker -> when ZAP let a connection of it in, not yet proven
        self.lock = threading.Lock()
        self.monitor_lock = threading.Lock()   # the monitor socket, read by the watchdog and by a first message
        self.failed = 0
        self.dropped: Counter[str] = Counter()
        self.name, self.told = name, set[tuple[str, str]]()   # (worker, why) of the drops already said
        self._trim_at: float | None = None
        self.cycle, self.cycles = threading.Condition(), 0   # watchdog passes, for admit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="psarch-connections", daemon=True)
        self._thread.start()

    def _held(self, now: float) -> Counter[str]:
        """Slots held, by worker: open connections their first message proved, and handshakes ZAP let in within
        prove_s, no more of them than connections are open unproven: a handshake's connection that closed before
        its first message holds none (ZeroMQ never retries a refused worker, and a worker whose connection dropped
        twice would otherwise be refused its next one; which worker's it was, the monitor does not say) (called
        holding the lock)."""
        held: Counter[str] = Counter(c.user for c in self.conns.values() if c.user is not None and not c.dropped)
        unproven = sum(1 for c in self.conns.values() if c.user is None and not c.dropped)
        for user, times in self.admitted.items():
            times[:] = [t for t in times if now - t <= self.caps.prove_s]
            held[user] += min(len(times), unproven)
        return held

    @property
    def authenticated(self) -> int:
        """Slots held: connections past a successful handshake (within prove_s of it, or proven) and still open."""
        with self.lock:
            return sum(self._held(time.monotonic()).values())

    def pending(self) -> int:
        """Open connections that no message has proved yet (handshakes in progress, refused, or silent)."""
        with self.lock:
            return sum(1 for c in self.conns.values() if c.user is None and not c.dropped)

    def admit(self, user: str) -> str | None:
        """ZAP's question for a handshake that proved `user` ("" for auth none): None if it may take a slot (then
        it holds one), else why not. It first waits until the watchdog has read every event up to now (a few
        PERIOD_S): the count must not lag behind a connection that just closed (ZeroMQ never retries a worker
        refused at a cap)."""
        with self.cycle:
            start = self.cycles
            self.cycle.wait_for(lambda: self.cycles >= start + 2, timeout=10 * PERIOD_S)
        now = time.monotonic()
        with self.lock:
            held = self._held(now)
            over = (f"over backend.max_connections = {self.caps.total}" if sum(held.values()) >= self.caps.total else
                    f"worker {user} holds backend.max_connections_per_worker = {self.caps.per_worker}"
                    if user and held[user] >= self.caps.per_worker else None)
            if over is None:
                self.admitted.setdefault(user, []).append(now)
            elif (user, "refused") not in self.told:   # a worker's: said once (ZeroMQ gives up on that server)
                self.told.add((user, "refused"))
                print(f"{self.name}: refused a handshake of {f'worker {user}' if user else 'a worker'} ({over}; "
                      f"handshakes not yet proven by a request count for backend.handshake_timeout_s): ZeroMQ never "
                      f"retries it, so what that worker sends this server is not answered", file=sys.stderr, flush=True)
        return over

    def received(self, frames: list[Any]) -> bool:
        """A message arrived (routing id first): count its bytes against its connection; its first proves who the
        connection is. False when the message must be ignored: it proves a connection that would take its
        worker, or the server, past a cap (one silent past handshake_timeout_s, whose slot lapsed), which is
        then dropped."""
        fd = frames[0].get(zmq.SRCFD) if hasattr(frames[0], "get") else -1
        if fd < 0:
            return True
        ident = frames[0].bytes
        if ident not in self.fds:
            # a connection's first message: its descriptor may be one a connection that just closed had, whose
            # DISCONNECTED the watchdog has not read yet; read it now (ZeroMQ queued it, and this connection's
            # ACCEPTED, before this message could arrive), or it would mark this connection's routing id gone
            # and its replies would never be sent
            self._events()
        with self.lock:
            if ident in self.gone:
                return True
            conn = self.conns.get(fd)
            if conn is None:   # (not setdefault: a Connection built and thrown away per message)
                conn = self.conns[fd] = Connection(time.monotonic())
            conn.framed += sum(len(f) + framing(len(f), self.curve) for f in frames[1:])
            self.fds[ident] = fd
            if conn.user is None and len(frames) > 1:
                user = _user_id(frames[1])
                times = self.admitted.get(user)
                if times:
                    times.pop(0)
                held = self._held(time.monotonic())
                if sum(held.values()) >= self.caps.total or (user and held[user] >= self.caps.per_worker):
                    conn.user = user   # named in the drop's line (a dropped connection holds no slot)
                    self._drop(fd, conn, "over_cap")
                    return False
                conn.user = user
            return True

    def drop_sender(self, frame: Any, why: str) -> None:
        """Shut down the connection a message (its routing id frame `frame`) came on."""
        fd = frame.get(zmq.SRCFD) if hasattr(frame, "get") else -1
        if fd >= 0 and frame.bytes not in self.fds:
            self._events()   # a first message: its descriptor's earlier connection's close first, as in received()
        with self.lock:
            conn = self.conns.setdefault(fd, Connection(time.monotonic())) if fd >= 0 else None
            if conn is not None:
                self._drop(fd, conn, why)

    def may_send(self, ident: bytes, nbytes: int) -> bool:
        """Whether a reply of `nbytes` to `ident` keeps its connection's unread bytes within budget (then it
        is counted as sent); if not, the connection is dropped and the reply must not be sent."""
        with self.lock:
            if ident in self.gone:
                return False   # ZeroMQ would drop it
            fd = self.fds.get(ident)
            conn = self.conns.get(fd) if fd is not None else None
            if fd is None or conn is None:
                return True
            budget = self.budget()
            if conn.sent + nbytes - conn.acked > budget:
                counters = tcp_counters(fd)
                if counters is not None:
                    conn.received, conn.acked = max(conn.received, counters[0]), max(conn.acked, counters[1])
            if conn.sent + nbytes - conn.acked <= budget:
                conn.sent += nbytes
                return True
            self._drop(fd, conn, "unread")
        return False

    def _drop(self, fd: int, conn: Connection, why: str) -> None:
        """Shut connection `fd` down, counting why once (called holding the lock)."""
        if not conn.dropped:
            conn.dropped = True
            self.dropped[why] += 1
            shut(fd)
            if conn.user is not None and (conn.user, why) not in self.told:   # a worker's: said once per why
                self.told.add((conn.user, why))
                who = f"worker {conn.user}'s" if conn.user else "a worker's"
                print(f"{self.name}: shut down {who} connection ({WHY[why]}); a request it had sent is answered "
                      f"once its worker sends it again, on its next connection", file=sys.stderr, flush=True)

    def _events(self) -> None:
        """Read the monitor's events (the watchdog's and a first message's thread: one at a time)."""
        with self.monitor_lock:
            if not self.monitor.closed:
                self._read_events()

    def _read_events(self) -> None:
        while self.monitor.poll(0):
            msg = parse_monitor_message(self.monitor.recv_multipart())
            event, fd = msg["event"], msg["value"]
            with self.lock:
                if event == zmq.EVENT_ACCEPTED:
                    conn = self.conns.get(fd)
                    if conn is None or conn.accepted:
                        self.conns[fd] = conn = Connection(time.monotonic())
                    conn.accepted = True
                elif event == zmq.EVENT_DISCONNECTED:
                    self.conns.pop(fd, None)
                    for ident in [i for i, f in self.fds.items() if f == fd]:
                        del self.fds[ident]
                        self.gone[ident] = None
                    while len(self.gone) > GONE:
                        del self.gone[next(iter(self.gone))]
                elif event & _FAILED:
                    self.failed += 1
            if event == zmq.EVENT_DISCONNECTED:
                self._trim_at = time.monotonic() + 0.1   # once ZeroMQ has freed the connection's pipes

    def _check(self, now: float) -> None:
        """Drop the connections holding more than the budget of unfinished inbound bytes, and the oldest pending
        connections past their cap."""
        budget = self.budget()
        beats = 2 * HEARTBEAT / self.heartbeat_s if self.heartbeat_s > 0 else 0.0
        with self.lock:
            pending = []
            for fd, c in self.conns.items():
                if c.user is None and not c.dropped:
                    pending.append((c.since, fd))
                counters = tcp_counters(fd)
                if counters is None:
                    continue
                if counters[0] < c.received or counters[1] < c.acked:   # another connection on a reused fd
                    c.framed = c.sent = 0
                    c.since = c.checked = now
                    c.floor = HANDSHAKE
                c.received, c.acked = counters
                # (received - framed) is what is in flight plus handshake and heartbeats: the latter are at most
                # what it is now (nothing in flight) and at most what they were plus what a heartbeat adds since
                unframed = c.received - c.framed
                c.floor, c.checked = min(unframed, c.floor + beats * (now - c.checked)), now
                if unframed - c.floor > budget:
                    self._drop(fd, c, "inflight")
            # past the cap, the oldest go: those a first message could still be on its way to prove kept
            over = max(0, len(pending) - self.caps.pending)
            for _, fd in [p for p in sorted(pending) if now - p[0] > self.caps.prove_s][:over]:
                self._drop(fd, self.conns[fd], "pending")

    def _watch(self) -> None:
        while not self._stop.wait(PERIOD_S):
            self._events()
            now = time.monotonic()
            self._check(now)
            if self._trim_at is not None and now >= self._trim_at:
                self._trim_at = None
                release_freed_memory()
            with self.cycle:
                self.cycles += 1
                self.cycle.notify_all()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with self.monitor_lock:
            self.monitor.close(0)


def _user_id(frame: Any) -> str:
    """The worker ZAP proved a message's connection to be ("" without auth)."""
    try:
        return frame.get("User-Id") or ""
    except (zmq.ZMQError, AttributeError):
        return ""
