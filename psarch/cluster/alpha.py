"""α, the per-message latency of the emulated network, measured once per run by a TCP ping-pong."""
from __future__ import annotations

import socket
import statistics
import threading
import time

from psarch.cluster import netns


def _echo(srv: socket.socket, rounds: int) -> None:
    conn, _ = srv.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            conn.sendall(conn.recv(1))


def measure_alpha(client_ns: str, server_ns: str, server_address: str, rounds: int = 50) -> float:
    """Half the median round-trip time of a 1-byte message between two namespaces, in seconds."""
    with netns.inside(server_ns):
        srv = socket.create_server((server_address, 0))
    t = threading.Thread(target=_echo, args=(srv, rounds), daemon=True)
    t.start()
    try:
        with netns.inside(client_ns):
            c = socket.create_connection((server_address, srv.getsockname()[1]), timeout=10)
        with c:
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
