"""Ranks that make no progress: once some rank of a run has ended (finished, or lost in a mode that goes on
without it), nothing else bounds the wait for the others, so a rank that streams no step record and uses no
CPU for longer than any wait of its own may last (stopped by SIGSTOP, hung outside any timed wait) is killed by
the launcher: `limit_s`, twice backend.timeout_s + 5 s (a PS worker gives up on a reply after timeout_s + 5 s,
and may wait a whole timeout_s first while a server decides a silent peer is lost). Its
error record says so, in the form the ranks' own take (psarch.launch.supervise), so the run names it like any failed
rank: a lost worker where the mode goes on without one, the run's error where it does not."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from psarch.launch import outputs


def _stat(pid: int | None) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first); [] where there is none (not Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def stopped(pid: int | None) -> bool:
    """Whether the process is stopped (SIGSTOP) or traced: Linux's state letter T or t."""
    return _stat(pid)[:1] in (["T"], ["t"])


def cpu_ticks(pid: int | None) -> int:
    """The process's CPU time so far (user + system, in clock ticks; 0 where unknown)."""
    fields = _stat(pid)
    return int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0


def limit_s(timeout_s: float) -> float:
    """How long a rank may make no progress once another has ended: longer than any wait of its own."""
    return 2 * timeout_s + 5.0


class Stalls:
    """Each rank's last progress (its step stream growing, its record appearing, its CPU time growing: a rank
    still starting up computes), and the kill of a rank that has made none for `timeout_s` since the later of
    that and the first rank's end."""

    def __init__(self, procs: list, out: Path, timeout_s: float) -> None:
        self.procs, self.out, self.timeout_s = procs, out, timeout_s
        self.limit_s = limit_s(timeout_s)
        self.seen: dict[int, tuple[int, bool, int]] = {}
        self.since: dict[int, float] = {}
        self.first_end: float | None = None

    def kill_stalled(self, alive: list) -> None:
        """Kill every rank of `alive` that has stalled; its exit is then reaped like any rank's."""
        now = time.monotonic()
        if len(alive) == len(self.procs):
            self.first_end = None   # nothing has ended: the ranks' and servers' own timeouts bound the waits
            return
        self.first_end = self.first_end or now
        for p in alive:
            r = self.procs.index(p)
            mark = self._progress(r, p.pid)
            if self.seen.get(r) != mark:
                self.seen[r], self.since[r] = mark, now
            if now - max(self.since[r], self.first_end) > self.limit_s:
                self._kill(r, p)

    def _progress(self, rank: int, pid: int) -> tuple[int, bool, int]:
        try:
            size = outputs.stream_path(self.out, rank).stat().st_size
        except OSError:
            size = -1
        return size, (self.out / outputs.RANKS_DIR / f"rank{rank}.json").exists(), cpu_ticks(pid)

    def _kill(self, rank: int, p) -> None:
        done = [r for r, q in enumerate(self.procs) if q.exitcode is not None]
        how = "was stopped (SIGSTOP?) and " if stopped(p.pid) else ""
        error = (f"Stalled: pid {p.pid} {how}made no progress for {self.limit_s:g} s (2 x backend.timeout_s = "
                 f"{self.timeout_s:g} s + 5) after rank(s) {done} ended; the launcher killed it")
        (self.out / outputs.RANKS_DIR / f"rank{rank}.error").write_text(json.dumps(
            {"rank": rank, "error": error, "failed_at_ns": time.monotonic_ns(), "traceback": ""}, indent=1) + "\n")
        print(f"psarch: rank {rank} killed: {error}", file=sys.stderr, flush=True)
        p.kill()
        p.join(5)
