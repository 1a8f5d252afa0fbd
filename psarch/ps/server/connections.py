"""Every connection a server holds, and what each may make it hold: the bound on one peer's memory.

ZeroMQ hands the server a message only once its last frame has arrived, and queues the replies a peer has not
read; no socket option bounds either (ZMQ_MAXMSGSIZE caps one frame; the high-water marks count messages, and a
message may have any number of frames). So the server counts, per TCP connection (the descriptor ZeroMQ's
monitor names when it accepts one, and that every message names, ZMQ_SRCFD):

- in flight in: bytes the kernel received on it (TCP_INFO) - the bytes of the messages the server was handed -
  what ZMTP itself sends (a frame's header and CURVE's box: at most FRAMING bytes a frame; the handshake: at most
  HANDSHAKE; heartbeats: at most 2 x HEARTBEAT bytes an interval);
- in flight out: bytes of the replies the server sent on it - bytes the peer acknowledged (TCP_INFO).

Over `budget` either way, the connection is shut down (ZeroMQ then frees its unfinished message and its queued
replies, and the heap gives the pages back to the system). A watchdog thread checks the inbound side every
PERIOD_S; a reply that would take the outbound side over budget is not sent. A connection thus makes a server
hold at most `budget` bytes each way, plus what its link delivers in PERIOD_S; ZeroMQ keeps a frame in at least
64 bytes, so a message of empty frames (2 bytes each on the wire without CURVE) holds up to 32 x its bytes.

It also counts handshakes (each connection: ACCEPTED, one HANDSHAKE_SUCCEEDED or HANDSHAKE_FAILED_*, then
DISCONNECTED), so that the connections past their handshake, not those still in it, fill backend.max_connections.
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from psarch.ps.server.libc import release_freed_memory

PERIOD_S = 0.01
FRAMING = 64          # bytes of ZMTP around one frame, at most (9 of header; CURVE: a MESSAGE box of 33 more)
HANDSHAKE = 16 * 1024  # bytes of a ZMTP handshake, at most (greeting 64; CURVE's HELLO/INITIATE < 1 kB)
HEARTBEAT = 64        # bytes of one PING or PONG, at most (CURVE-boxed)
GONE = 4096           # routing ids of closed connections remembered
PER_PARTITION = 1024  # bytes each way of one partition's messages beyond its elements: a push (or pushpull) in,
                      # its ack and its pull's reply out, each a header of ~130 bytes and its frames' ZMTP framing
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _FAILED


@dataclass
class Connection:
    """What the server knows of one TCP connection."""

    since: float
    delivered: int = 0     # bytes of the messages handed to the server
    frames: int = 0        # their frames
    sent: int = 0          # bytes of the replies the server gave ZeroMQ for it
    received: int = 0      # the kernel's counters when last read
    acked: int = 0
    dropped: bool = False  # shut down by the server (ZeroMQ has not said it closed yet)
    accepted: bool = False  # the monitor's ACCEPTED seen (a first message may come first: the monitor lags)


def exchange_budget(elements: int, partitions: int, row_bytes: int, max_header: int) -> int:
    """The default bound on what one connection may have in flight each way (backend.inflight_mb = 0): twice
    the largest exchange of a worker with a server, so that two may be unread at once, + 1 MiB. An exchange:
    the server's range in fp32 (`elements`) sent as `partitions` messages back to back, each with its own
    header and framing (PER_PARTITION), every row the server owns with its key, and two headers of slack."""
    exchange = 4 * elements + partitions * PER_PARTITION + 2 * max_header + row_bytes
    return 2 * exchange + 2**20


def tcp_counters(fd: int) -> tuple[int, int] | None:
    """(bytes received, bytes sent and acknowledged) of TCP socket `fd` (Linux's TCP_INFO); None if it is gone."""
    try:
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as s:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    if len(info) < 136:
        return None
    acked, received = struct.unpack_from("QQ", info, 120)   # tcpi_bytes_acked, tcpi_bytes_received
    return received, acked


def shut(fd: int) -> None:
    """End TCP connection `fd` at once (a reset: its buffers are freed now); ZeroMQ then closes its side."""
    try:
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Connections:
    """The connections of one ROUTER, what each has in flight, and a watchdog that drops those over `budget`
    (a function: the budget follows what the server holds). `dropped` counts drops by reason."""

    def __init__(self, sock: zmq.Socket, budget: Callable[[], int], heartbeat_s: float) -> None:
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.budget, self.heartbeat_s = budget, heartbeat_s
        self.conns: dict[int, Connection] = {}
        self.fds: dict[bytes, int] = {}          # routing id -> descriptor, from the messages
        # routing ids of closed connections: ZeroMQ still hands over what they sent, and drops what they are sent
        self.gone: dict[bytes, None] = {}
        self.lock = threading.Lock()
        self.succeeded = self.failed = self.closed = 0
        self.dropped: Counter[str] = Counter()
        self._trim_at: float | None = None
        self.cycle, self.cycles = threading.Condition(), 0   # watchdog passes, for room_for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="psarch-connections", daemon=True)
        self._thread.start()

    @property
    def authenticated(self) -> int:
        """Connections past a successful handshake and still open (a failed one counts until it closes)."""
        return max(0, self.succeeded + self.failed - self.closed)

    def room_for(self, limit: int) -> bool:
        """Whether fewer than `limit` connections are past their handshake. It first waits until the watchdog has
        read every event up to now (a few PERIOD_S; only authenticated handshakes ask): the count must not lag
        behind a handshake that just succeeded (the cap would let one more in) nor behind a connection that
        just closed (ZeroMQ never retries a worker refused at the cap)."""
        with self.cycle:
            start = self.cycles
            self.cycle.wait_for(lambda: self.cycles >= start + 2, timeout=10 * PERIOD_S)
        return self.authenticated < limit

    def received(self, frames: list[Any]) -> None:
        """A message arrived (routing id first): count its bytes against its connection."""
        fd = frames[0].get(zmq.SRCFD) if hasattr(frames[0], "get") else -1
        if fd < 0:
            return
        ident = frames[0].bytes
        with self.lock:
            if ident in self.gone:
                return
            conn = self.conns.setdefault(fd, Connection(time.monotonic()))
            conn.delivered += sum(len(f) for f in frames[1:])
            conn.frames += len(frames) - 1
            self.fds[ident] = fd

    def may_send(self, ident: bytes, nbytes: int) -> bool:
        """Whether a reply of `nbytes` to `ident` keeps its connection's unread bytes within budget (then it
        is counted as sent); if not, the connection is dropped and the reply must not be sent."""
        with self.lock:
            if ident in self.gone:
                return False   # ZeroMQ would drop it
            fd = self.fds.get(ident)
            conn = self.conns.get(fd) if fd is not None else None
            if conn is None:
                return True
            if conn.sent + nbytes - conn.acked > self.budget():
                counters = tcp_counters(fd)
                if counters is not None:
                    conn.received, conn.acked = max(conn.received, counters[0]), max(conn.acked, counters[1])
            if conn.sent + nbytes - conn.acked <= self.budget():
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

    def _events(self) -> None:
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
                    self.closed += 1
                    self.conns.pop(fd, None)
                    for ident in [i for i, f in self.fds.items() if f == fd]:
                        del self.fds[ident]
                        self.gone[ident] = None
                    while len(self.gone) > GONE:
                        del self.gone[next(iter(self.gone))]
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.succeeded += 1
                else:
                    self.failed += 1
            if event == zmq.EVENT_DISCONNECTED:
                self._trim_at = time.monotonic() + 0.1   # once ZeroMQ has freed the connection's pipes

    def _check(self, now: float) -> None:
        """Drop the connections holding more than the budget of unfinished inbound bytes."""
        budget = self.budget()
        beats = 2 * HEARTBEAT / self.heartbeat_s if self.heartbeat_s > 0 else 0.0
        with self.lock:
            for fd, c in self.conns.items():
                counters = tcp_counters(fd)
                if counters is None:
                    continue
                if counters[0] < c.received or counters[1] < c.acked:   # another connection on a reused fd
                    c.delivered = c.frames = c.sent = 0
                    c.since = now
                c.received, c.acked = counters
                zmtp = HANDSHAKE + FRAMING * c.frames + beats * (now - c.since)
                if c.received - c.delivered - zmtp > budget:
                    self._drop(fd, c, "inflight")

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
        self.monitor.close(0)
