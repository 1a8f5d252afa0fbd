"""What the parameter-server tests share beyond tests/parity.py: plain SGD, and the ps backend section."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

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
