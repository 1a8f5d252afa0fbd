"""What the parameter-server tests share beyond tests/parity.py: plain SGD, the ps backend section, the config of
a server under pressure, and a raw peer speaking the wire."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import zmq

from psarch.config import from_dict
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from dist_utils import run_ranks
from parity import OPTIMIZERS as _PARITY, TINY_GPT, config  # noqa: F401  (re-exported for the PS tests)
from timing import scaled

OPTIMIZERS = dict(_PARITY, plain_sgd={"optimizer": "sgd", "lr": 0.1})


def ps(n: int, mode: str = "sync", servers: int = 1, **extra) -> dict:
    """A PS backend table; each server's range whole (partition_mb = 0) unless a test asks for partitions, so the
    tests that count messages or name offsets do not depend on backend.partition_mb's default."""
    return dict({"kind": "ps", "world_size": n, "mode": mode, "servers": servers, "timeout_s": 60.0,
                 "partition_mb": 0.0}, **extra)


def run_stage(out: Path, services: dict[str, Any], fn: Callable, n: int) -> list:
    """Run `fn` on n worker ranks against each case's started `services`, then finish and stop them."""
    return run_with_stats(out, services, fn, n)[0]


def run_with_stats(out: Path | str, services: dict[str, Any], fn: Callable, n: int) -> tuple[list, dict[str, Any]]:
    """run_stage, returning the ranks' results and each case's servers' statistics (what finish returns)."""
    try:
        results = run_ranks(fn, n, str(out), {c: s.info for c, s in services.items()}, timeout=scaled(300))
        stats = {c: s.finish() for c, s in services.items()}
    finally:
        for s in services.values():
            s.stop()
    return results, stats


def pressure_config(mode: str = "async", optimizer: str = "sgd", workers: int = 2, **backend):
    """An MLP's PS run at lr 0.5 (backend.auth "plain" unless given): the servers of tests/test_ps_pressure*.py."""
    return from_dict(config("pressure", train={"optimizer": optimizer, "lr": 0.5}, workload={"model": "mlp"},
                            backend=ps(workers, mode, auth=backend.pop("auth", "plain"), **backend)))


class Raw:
    """One DEALER speaking the wire directly to a server, for requests a PSClient would never send;
    authenticated as `worker` with the run's credentials `creds` (None: no handshake)."""

    def __init__(self, zctx: zmq.Context, address: str, creds: dict | None = None, worker: int = 0) -> None:
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        auth.client_socket(self.sock, Credentials.from_dict(creds), worker, 0)
        self.sock.connect(address)

    def send(self, header: dict, tensor: torch.Tensor | None = None) -> None:
        self.sock.send_multipart(wire.encode(header, tensor))

    def reply(self, timeout_ms: int = 5000) -> wire.Message | None:
        return wire.decode(self.sock.recv_multipart()) if self.sock.poll(timeout_ms) else None

    def ask(self, header: dict, tensor: torch.Tensor | None = None) -> wire.Message:
        self.send(header, tensor)
        r = self.reply()
        assert r is not None, f"no reply to {header}"
        return r
