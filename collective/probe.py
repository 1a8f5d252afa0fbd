"""A ring hop's cost on this machine, for dilation's probe (psarch.cluster.messages): two processes joined in a
gloo process group, as a ring's ranks are, exchange PAYLOAD fp32 elements with each other through the ring's own
send and receive (collective.comm.exchange: the receive posted, then the send, both waited for), a ring of two,
for PROBE_S after WARMUP exchanges. Seconds per message: an exchange's wall time / 2 (each rank sends one message
and takes one)."""
from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from collective.comm import exchange
from psarch.cluster.messages import LIMIT_S, answer, forked, receive
from psarch.launch.spawn import LOOPBACK

PAYLOAD = 64
PROBE_S = 0.3
WARMUP = 10


def hop_s(comm: str = "ring") -> float:
    """Seconds per message between two processes of this machine over gloo: a ring hop through the ring's own send
    and receive (comm "ring"), or gloo's own all-reduce of the same payload (comm "native": each rank sends one
    message and takes one, as a hop)."""
    deadline = time.monotonic() + LIMIT_S
    with tempfile.TemporaryDirectory(prefix="psarch-hop-") as tmp:
        store = os.path.join(tmp, "store")
        with forked(_rank, 1, store, comm) as other, forked(_rank, 0, store, comm) as conn:
            return float(receive(conn, "the ring probe's rank 0", deadline,
                                 (other, "the ring probe's rank 1"))["seconds"])


def _rank(conn: Connection, rank: int, store: str, comm: str) -> None:
    """Rank 0 says in each exchange's first element whether another follows (1) or not (0), so both ranks make
    as many; it answers the probe."""
    os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK   # this machine's loopback, whatever its hostname resolves to
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=LIMIT_S))
    send, recv = torch.ones(PAYLOAD), torch.empty(PAYLOAD)
    exchanges, t0 = 0, 0.0
    while True:
        if rank == 0:
            exchanges += 1
            t0 = time.perf_counter() if exchanges == WARMUP else t0
            send[0] = float(exchanges < WARMUP or time.perf_counter() - t0 < PROBE_S)
        if comm == "native":   # the flag is rank 0's: the sum of rank 0's and rank 1's (0) is rank 0's
            recv.copy_(send if rank == 0 else send.zero_())
            dist.all_reduce(recv)
        else:
            for work in exchange(send, 1 - rank, recv, 1 - rank, None, "gloo"):
                work.wait()
        if (send if rank == 0 else recv)[0] == 0:
            break
    if rank == 0:
        answer(conn, seconds=(time.perf_counter() - t0) / ((exchanges - WARMUP + 1) * 2))
