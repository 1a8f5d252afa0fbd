"""A world's start-up paced as the cluster's (faults.startup_s), as a virtual device paces a step's compute: the
world's ranks start up for real (spawned, imports, process group, checkpoint read), then each waits until the
world's launch + startup_s x D of wall clock before it begins its first step, so the world's first step (when its
last rank began it, psarch.launch.worlds) lands at that deadline. A rank that is ready only after the deadline
overran: this host, not the cluster, set the world's start-up; the world is reported as a start-up overrun.

The deadline's origin is the launcher's (time.monotonic() as it launched the world, handed to every rank in its
RankJob): CLOCK_MONOTONIC is one clock for every process of this machine, as the ranks' first-step marks. The
virtual device's Phase (psarch.cluster.pacing) keeps its own origin in the rank, so the wait is the same sleep to
a deadline, here against the launcher's origin.

startup_s may be longer than any timeout of the run: no wait runs across the hold. Those of the start-up end
before it (the rendezvous and the process group's set-up, the PS workers' first pull, ZeroMQ's handshakes: the
host's start-up, which backend.timeout_s and handshake_timeout_s bound), and those of a step begin after it,
every rank leaving the hold at the same deadline (a collective, a sync round, a reply); ZeroMQ's heartbeats go on
in its own threads while a rank sleeps; the PS servers, which do not hold, have nothing pending meanwhile (no pull,
no round begun), and the silence of a worker is watched by standalone servers only (no launcher, no deadline). So
nothing is refused or stretched for it (tests/test_startup_paced.py runs a sync PS through a hold past each of its
timeouts). Every timeout is the cluster's time too (x D, psarch/cluster/dilation.py)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from psarch.cluster.device import dilation

if TYPE_CHECKING:
    from psarch.config import Config


def deadline(cfg: Config, launched: float | None) -> float | None:
    """When (time.monotonic()) a world launched at `launched` begins its first step: launched + startup_s x D; None
    where the start-up is not paced (faults.startup_s = 0, or no launch time handed down)."""
    if not cfg.faults.startup_s or launched is None:
        return None
    return launched + cfg.faults.startup_s * dilation(cfg)


def hold(until: float | None) -> float | None:
    """Wait until `until` (time.monotonic()); how late this rank was ready past it (wall seconds, 0 on time); None
    where there is no deadline."""
    if until is None:
        return None
    ahead = until - time.monotonic()
    if ahead > 0:
        time.sleep(ahead)
    return max(0.0, -ahead)


def summary(cfg: Config, worlds: list[Any]) -> dict[str, Any]:
    """summary.json's `startup` (faults.startup_s > 0): the paced start-up, the worlds counted and those whose ranks
    were ready only after their deadline (overran: `startup_late_s`, the cluster's seconds, > 0), and the line such
    a run ends with."""
    late = [w.get("startup_late_s") for w in worlds]
    over = [i for i, x in enumerate(late) if x]
    out: dict[str, Any] = {"startup_s": cfg.faults.startup_s, "counted_worlds": len(worlds),
                           "overrun_worlds": len(over), "late_s": late}
    out["warning"] = (f"start-up: {len(over)} of {len(worlds)} world(s) ({', '.join(map(str, over))}) started up "
                      f"after launch + faults.startup_s = {cfg.faults.startup_s:g} s (late by up to "
                      f"{max(x for x in late if x):.3f} s): this machine, not the cluster, set their start-up; raise "
                      f"faults.startup_s or cluster.dilation") if over else None
    return out


def report_lines(s: dict[str, Any]) -> list[str]:
    """report.txt's line on the paced start-up, and the overrun line where there is one."""
    line = (f"start-up        paced to faults.startup_s = {s['startup_s']:g} s (the cluster's) in "
            f"{s['counted_worlds'] - s['overrun_worlds']} of {s['counted_worlds']} world(s); overrun "
            f"{s['overrun_worlds']}")
    return [line] + ([s["warning"]] if s.get("warning") else [])
