"""Ranks spawned on this machine, watched until they end: a rank that fails stops the whole run with the
error that caused it (not a peer's echo of it), and nothing is left running.

Each rank writes `ranks/rank<R>.error` when it fails (its first line, traceback, and when, on this machine's
monotonic clock); a rank that left none was killed, and the launcher says by what where it can tell.

Every wait is bounded: once some rank has ended, a rank that streams no step and uses no CPU for
2 x backend.timeout_s + 5 s (stopped by SIGSTOP, hung) is killed, named in its error record and on stderr
(psarch.launch.stalls). A run that stops, spawned or under torchrun, keeps the steps its ranks finished
(keep_finished_steps)."""
from __future__ import annotations

import json
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, TypedDict

from psarch.config import Config
from psarch.launch import outputs
from psarch.errors import NON_FINITE_EXIT, NonFiniteGradient, RunError
from psarch.launch.lifecycle import ECHO_GRACE_S, TICK_S, ended
from psarch.launch.stalls import Stalls, stopped
from psarch.records import Summary

# How a peer's failure reaches a rank that did nothing wrong: its sockets close, its collectives time out.
_PEER_ECHOES = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
                "end of file", "socket timeout", "timed out", "timeout", "distnetworkerror", "distbackenderror",
                "gloo", "tcpstore")


def write_error(out: Path, rank: int, e: BaseException) -> None:
    """The rank's error record. `failed_at_ns` is CLOCK_MONOTONIC, one clock for every process of this
    machine, fine enough to order a failure before the peers' echoes of it (file mtimes are not)."""
    (out / outputs.RANKS_DIR / f"rank{rank}.error").write_text(json.dumps(
        {"rank": rank, "error": f"{type(e).__name__}: {e}".splitlines()[0], "failed_at_ns": time.monotonic_ns(),
         "traceback": traceback.format_exc()}, indent=1) + "\n")


class RankError(TypedDict):
    """ranks/rank<R>.error: what a rank that failed left (write_error)."""

    rank: int
    error: str                   # its first line
    failed_at_ns: int            # time.monotonic_ns() when it failed
    traceback: str


def read_error(out: Path, rank: int) -> RankError | None:
    try:
        return json.loads((out / outputs.RANKS_DIR / f"rank{rank}.error").read_text())
    except (OSError, ValueError):
        return None


def root_cause(out: Path, failed: dict[int, int]) -> int:
    """Of several failed ranks ({rank: exit code}), the one whose error caused the others': a non-finite
    loss (in ddp/zero the all-reduce spreads it, and its peers' refused non-finite gradients echo it), then
    non-finite gradients, then an error that is not a peer's echo, then the earliest; among those, a rank
    that left no record (killed) comes first."""
    def key(rank: int) -> tuple[bool, bool, bool, int]:
        rec = read_error(out, rank)
        echo = rec is not None and any(e in rec["error"].lower() for e in _PEER_ECHOES)
        grads = rec is not None and rec["error"].startswith(NonFiniteGradient.__name__)
        return (failed[rank] != NON_FINITE_EXIT, grads, echo, rec["failed_at_ns"] if rec is not None else -1)
    return min(failed, key=key)


def failed_with(out: Path, rank: int, error: type[BaseException]) -> bool:
    """Whether rank `rank` failed with an error of type `error` (by its record's name)."""
    rec = read_error(out, rank)
    return rec is not None and rec["error"].startswith(f"{error.__name__}:")


def rank_error(out: Path, rank: int, code: int | None) -> str:
    """What a failed rank says: its error record, or how it ended when it left none."""
    rec = read_error(out, rank)
    if rec is not None:
        return f"rank {rank} failed: {rec['error']}\n{rec['traceback']}"
    return f"rank {rank} {ended(code)} before it could report an error"


def watch(procs: list, out: Path, lost: Callable[[list[int]], bool] | None, check: Callable[[], None],
          timeout_s: float, tick: Callable[[], None] | None = None) -> None:
    """Wait until every rank has exited. A failed rank stops the run with a RunError naming the root cause,
    unless `lost(ranks)` takes the failed ranks as lost workers (the run goes on); `check()` raises when a
    service failed. A rank that makes no progress for 2 x `timeout_s` + 5 s once another has ended is killed.
    `tick()`, where given, runs every TICK_S (the faults a run injects, psarch/launch/faults.py)."""
    alive = list(procs)
    stalls = Stalls(procs, out, timeout_s)
    while alive:
        wait([p.sentinel for p in alive], timeout=0.5 if tick is None else TICK_S)
        if tick is not None:
            tick()
        failed = _reap(alive, procs)
        if failed and (lost is None or not lost(failed)):
            # its peers fail moments later ("connection reset by peer"): let them, then name the cause
            deadline = time.monotonic() + ECHO_GRACE_S
            while alive and time.monotonic() < deadline:
                wait([p.sentinel for p in alive], timeout=max(0.0, deadline - time.monotonic()))
                failed += _reap(alive, procs)
            first = root_cause(out, {r: procs[r].exitcode for r in failed})
            raise RunError(_stopped_peer(procs, alive) + rank_error(out, first, procs[first].exitcode))
        check()
        stalls.kill_stalled(alive)


def _stopped_peer(procs: list, alive: list) -> str:
    """Where a rank that is still alive is stopped (SIGSTOP), it is the cause its failed peers waited on."""
    held = [procs.index(p) for p in alive if stopped(p.pid)]
    return (f"rank {held[0]} (pid {procs[held[0]].pid}) is stopped (SIGSTOP?); its peers failed waiting for it: "
            if held else "")


def stop(procs: list) -> None:
    """Terminate every rank still alive, then kill what ignores it."""
    procs = [p for p in procs if p.pid is not None]   # a failed start leaves the rest unstarted: not joinable
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _reap(alive: list, procs: list) -> list[int]:
    """Remove the exited processes from `alive`; the ranks of those that failed."""
    exited = [p for p in alive if p.exitcode is not None]
    for p in exited:
        alive.remove(p)
    return [procs.index(p) for p in exited if p.exitcode != 0]


def keep_finished_steps(out: Path, cfg: Config, e: BaseException, extra: Summary | None = None) -> None:
    """A run that failed or was interrupted by `e`: its summary says so and why, beside the steps its ranks finished
    (outputs.finalize_stopped); a failure to write them is printed, never raised over `e`."""
    status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
    error = str(e) if isinstance(e, RunError) else f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    try:
        outputs.finalize_stopped(out, cfg, status, error, extra)
    except Exception as w:  # never hide the run's own error behind this one
        print(f"psarch: could not write the {status} run's summary: {type(w).__name__}: {w}", file=sys.stderr)
