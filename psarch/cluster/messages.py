"""This machine's cost per message of a backend's own code path, which dilation stretches the links past
(psarch.cluster.dilation). A backend names how its messages move (BackendSpec.message_probe: a MessageProbe,
e.g. an exchange through a real parameter server, or a ring hop over gloo); the probe runs it in processes forked
from this one (a spawned interpreter's import of torch alone costs seconds at load), each killed once the probe
has its answer, and all within LIMIT_S. A probe is measured once per process count in a launcher's life: a sweep
resolves D per point, and points alike share it.

Seconds per message: the exchange's wall time / the messages one end of it sent and took (a request and its
reply are two, as a step's program counts them: psarch.cluster.dilation.program_load).
"""
from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator

from psarch.launch.lifecycle import die_with_parent, leave

LIMIT_S = 60.0   # a probe's processes, from their start to its answer; past it the probe fails, naming itself


@dataclass(frozen=True)
class MessageProbe:
    """`run(*args)`: seconds per message of a backend's code path on this machine, measured now. `family` names
    the path (said in the run's first line); `args` what its cost depends on (workers, partitions a server holds)."""

    family: str
    run: Callable[..., float]
    args: tuple = ()


class ProbeError(RuntimeError):
    """A probe that failed or did not answer within LIMIT_S: one line naming it."""


@functools.lru_cache(maxsize=None)
def per_message_s(probe: MessageProbe, processes: int) -> float:
    """`probe`'s seconds per message, measured the first time it is asked for beside `processes` busy processes
    (psarch.cluster.dilation.spinning), then remembered."""
    return probe.run(*probe.args)


@contextlib.contextmanager
def forked(target: Callable[..., None], *args: Any) -> Iterator[Connection]:
    """`target(conn, *args)` in a forked process (one thread of torch) for the block, which gets the pipe's other
    end; the process killed after it."""
    for stream in (sys.stdout, sys.stderr):   # else the child would write this process's buffered output again
        with contextlib.suppress(OSError, ValueError):   # closed or broken: nothing buffered to write twice
            stream.flush()
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_side, args=(target, child, args), daemon=True)
    proc.start()
    child.close()
    try:
        yield parent
    finally:
        proc.kill()
        proc.join()
        parent.close()


def _side(target: Callable[..., None], conn: Connection, args: tuple) -> None:
    die_with_parent()
    import torch
    torch.set_num_threads(1)
    try:
        target(conn, *args)
    except BaseException as e:   # said to the probe, which raises it as one line
        with contextlib.suppress(OSError):
            conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        leave(1)
    leave(0)


def answer(conn: Connection, **fields: Any) -> None:
    """A forked side's answer to the probe."""
    conn.send_bytes(json.dumps(fields).encode())


def receive(conn: Connection, who: str, deadline: float) -> dict[str, Any]:
    """The answer of `who` on `conn` by `deadline` (time.monotonic()); a failure, an exit or silence raises."""
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise ProbeError(f"cluster.dilation = \"auto\": {who} did not answer within {LIMIT_S:g} s (this machine "
                         f"is too loaded to probe its cost per message; set a number for cluster.dilation)")
    try:
        got = json.loads(conn.recv_bytes())
    except (EOFError, OSError):
        raise ProbeError(f"cluster.dilation = \"auto\": {who} exited before it answered") from None
    if "error" in got:
        raise ProbeError(f"cluster.dilation = \"auto\": {who} failed: {got['error']}")
    return got
