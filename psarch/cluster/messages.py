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
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator

from psarch.launch.lifecycle import die_with_parent, leave

LIMIT_S = 60.0   # a probe's processes, from their start to its answer; past it the probe fails, naming itself


@dataclass(frozen=True)
class MessageProbe:
    """`run(*args)`: seconds per message of a backend's code path on this machine, measured now. `family` names
    the path (said in the run's first line); `args` what its cost depends on (workers, partitions a server holds)."""

    family: str
    run: Callable[..., float]   # a module-level function, so that probes alike share one measurement
    args: tuple = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.args, tuple) and all(isinstance(a, (str, int, float)) for a in self.args)):
            raise ValueError(f"MessageProbe {self.family!r}: args must be a tuple of str, int or float (it keys "
                             f"the probe's cache), not {self.args!r}")


class ProbeError(RuntimeError):
    """A probe that failed or did not answer within LIMIT_S: one line naming it."""


@functools.lru_cache(maxsize=None)
def per_message_s(probe: MessageProbe, processes: int) -> float:
    """`probe`'s seconds per message, measured the first time it is asked for, its two processes beside
    `processes - 2` busy ones (spinning), then remembered (a hit starts nothing)."""
    with spinning(max(0, processes - 2)):
        return probe.run(*probe.args)


@contextlib.contextmanager
def spinning(n: int) -> Iterator[None]:
    """`n` processes spinning on the CPU for the block: the run's other processes, all computing."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


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


def receive(conn: Connection, who: str, deadline: float, *others: tuple[Connection, str]) -> dict[str, Any]:
    """The answer of `who` on `conn` by `deadline` (time.monotonic()); a failure, an exit or silence raises, and so
    does a failure of any of the probe's `others` sides (conn, who) meanwhile, naming that side (one that says
    nothing and ends, as a ring's rank 1 does once the exchanges are over, is let go)."""
    sides = {conn: who, **dict(others)}
    while True:
        ready = wait(list(sides), max(0.0, deadline - time.monotonic()))
        if not ready:
            raise ProbeError(f"cluster.dilation = \"auto\": {who} did not answer within {LIMIT_S:g} s (this "
                             f"machine is too loaded to probe its cost per message; set a number for "
                             f"cluster.dilation)")
        for c in sorted((c for c in sides if c in ready), key=lambda c: c is conn):   # another side's first: the cause
            try:
                got = json.loads(c.recv_bytes())
            except (EOFError, OSError):
                if c is not conn:
                    del sides[c]
                    continue
                raise ProbeError(f"cluster.dilation = \"auto\": {who} exited before it answered") from None
            if "error" in got:
                raise ProbeError(f"cluster.dilation = \"auto\": {sides[c]} failed: {got['error']}")
            if c is conn:
                return got
