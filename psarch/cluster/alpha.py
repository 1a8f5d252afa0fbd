"""α, the per-message latency of the emulated network, measured once per run by a TCP ping-pong; and this
machine's own costs of a message on loopback (α and bytes/s), which dilation must stretch the links past."""
from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time
from typing import Callable

from psarch.cluster import netns


def _echo(srv: socket.socket, rounds: int) -> None:
    conn, _ = srv.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            conn.sendall(conn.recv(1))


def _ping_pong(srv: socket.socket, connect: Callable[[], socket.socket], rounds: int) -> float:
    t = threading.Thread(target=_echo, args=(srv, rounds), daemon=True)
    t.start()
    try:
        with connect() as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rtts = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                c.sendall(b"x")
                c.recv(1)
                rtts.append(time.perf_counter() - t0)
        t.join(10)
    finally:
        srv.close()
    return statistics.median(rtts) / 2


def measure_alpha(client_ns: str, server_ns: str, server_address: str, rounds: int = 50) -> float:
    """Half the median round-trip time of a 1-byte message between two namespaces, in seconds."""
    with netns.inside(server_ns):
        srv = socket.create_server((server_address, 0))

    def connect() -> socket.socket:
        with netns.inside(client_ns):
            return socket.create_connection((server_address, srv.getsockname()[1]), timeout=10)
    return _ping_pong(srv, connect, rounds)


def loopback_alpha(rounds: int = 50) -> float:
    """α of this machine's loopback (no namespace, no shaping): the host's own per-message latency."""
    srv = socket.create_server(("127.0.0.1", 0))
    return _ping_pong(srv, lambda: socket.create_connection(("127.0.0.1", srv.getsockname()[1]), timeout=10), rounds)


def loopback_bytes_per_s(nbytes: int, rounds: int = 3) -> float:
    """Bytes/s of a TCP stream of `nbytes` on this machine's loopback, the median of `rounds`: the host's
    own cost per byte."""
    return statistics.median(_stream_bytes_per_s(nbytes) for _ in range(rounds))


def _stream_bytes_per_s(nbytes: int) -> float:
    srv = socket.create_server(("127.0.0.1", 0))
    received = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        buf = bytearray(1 << 20)
        with conn:
            while received[0] < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    return
                received[0] += n
    t = threading.Thread(target=sink, daemon=True)
    t.start()
    payload = bytes(nbytes)
    with contextlib.closing(srv), socket.create_connection(("127.0.0.1", srv.getsockname()[1]), timeout=10) as c:
        t0 = time.perf_counter()
        c.sendall(payload)
        t.join(60)
        elapsed = time.perf_counter() - t0
    return nbytes / elapsed
