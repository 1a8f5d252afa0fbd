"""What the parameter-server tests share beyond tests/parity.py: plain SGD, and the ps backend section."""
from __future__ import annotations

from parity import OPTIMIZERS as _PARITY, TINY_GPT, config  # noqa: F401  (re-exported for the PS tests)

OPTIMIZERS = dict(_PARITY, plain_sgd={"optimizer": "sgd", "lr": 0.1})


def ps(n: int, mode: str = "sync", servers: int = 1, **extra) -> dict:
    return dict({"kind": "ps", "world_size": n, "mode": mode, "servers": servers, "timeout_s": 60.0}, **extra)
