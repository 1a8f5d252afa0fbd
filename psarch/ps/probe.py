"""The PS's cost per message on this machine, for dilation's probe (psarch.cluster.messages): a real
ParameterServer (sync, the run's optimizer, `partitions` partitions of PARTITION_ALIGN fp32 elements, so the bytes
cost nothing and what is timed is the per-message work: framing, validation, the handler and update, ZeroMQ, the
wake-ups; auth "none": a handshake costs per connection, not per message) in a process of its own, and `workers`
workers' PSClients in another. A round is what each worker does
each step: a pushpull per partition, all sent back to back, then every reply taken. One round untimed (the
handshakes), then rounds for PROBE_S. Seconds per message: their wall time / the server's messages in them (each
pushpull and its reply). Bounded: at most MAX_WORKERS workers and MAX_EXCHANGES pushpulls a round (fewer
partitions where more would pass it)."""
from __future__ import annotations

import time
from multiprocessing.connection import Connection

import torch

from psarch.cluster.messages import LIMIT_S, answer, forked, receive
from psarch.config import from_dict
from psarch.ps.auth import Credentials
from psarch.ps.partitions import PARTITION_ALIGN
from psarch.ps.server.start import build_server   # imported here, once: a forked side finds them imported
from psarch.ps.worker.client import PSClient, Request

PROBE_S = 0.3
MAX_WORKERS = 64
MAX_EXCHANGES = 1024


def message_s(workers: int, partitions: int, optimizer: str) -> float:
    """Seconds per message through a ParameterServer of `partitions` partitions and `workers` workers."""
    workers = min(workers, MAX_WORKERS)
    partitions = max(1, min(partitions, MAX_EXCHANGES // workers))
    cfg = from_dict({"train": {"optimizer": optimizer, "global_batch": workers},
                     "backend": {"kind": "ps", "world_size": workers, "servers": 1, "mode": "sync",
                                 "timeout_s": LIMIT_S, "partition_mb": PARTITION_ALIGN * 4 / 2**20,
                                 "partition_assignment": "ranges", "auth": "none"}})
    # torch's lazy imports of a first optimizer (seconds at load) done here, once: every forked server finds them
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    deadline = time.monotonic() + LIMIT_S
    with forked(_server, cfg.to_dict()) as server:
        address = receive(server, "the PS probe's server", deadline)["address"]
        with forked(_workers, cfg.to_dict(), address, partitions) as clients:
            return float(receive(clients, "the PS probe's workers", deadline,
                                 (server, "the PS probe's server"))["seconds"])


def _server(conn: Connection, cfg: dict) -> None:
    server = build_server(0, from_dict(cfg), "127.0.0.1", 0, build=False, pipe=conn, creds=Credentials("none"))
    answer(conn, address=server.address)
    server.serve()


def _workers(conn: Connection, cfg: dict, address: str, partitions: int) -> None:
    n, numel = from_dict(cfg).backend.world_size, PARTITION_ALIGN * partitions
    clients = [PSClient([address], w, timeout_s=LIMIT_S) for w in range(n)]
    grad, flats = torch.full((numel,), 1e-3), [torch.empty(numel) for _ in clients]
    clients[0].exchange([[Request({"op": "init", "numel": numel, "offset": 0}, torch.zeros(numel))]])
    rounds, t0 = 0, 0.0
    while rounds == 0 or time.perf_counter() - t0 < PROBE_S:
        for client, flat in zip(clients, flats):
            for a in range(0, numel, PARTITION_ALIGN):
                b = a + PARTITION_ALIGN
                client.post(0, Request({"op": "pushpull", "step": rounds, "version": rounds, "offset": a}, grad[a:b],
                                       into=flat[a:b]))
        for client in clients:
            client.wait()
        rounds += 1
        t0 = t0 or time.perf_counter()   # after the first round: its handshakes untimed
    answer(conn, seconds=(time.perf_counter() - t0) / ((rounds - 1) * 2 * n * partitions))
