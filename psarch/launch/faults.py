"""The launcher's side of [faults] (psarch/config/faults.py): strike each fault as its worker holds itself at
the fault's step, continue a paused node after its seconds, and record what was done, when, for summary.json;
with faults.restart = "replace", what a restarted world is given (the faults that have not struck yet).

A worker holds at a fault's step by stopping itself (SIGSTOP, psarch.launch.runner); the launcher sees it
stopped with that many steps streamed, strikes (SIGKILL; SIGSTOP, then SIGCONT after the pause), and lets
the worker go on (SIGCONT) unless the fault was its own."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Callable, TypedDict

from psarch.checkpoint import latest_complete
from psarch.checkpoint.start import CHECKPOINTS, resolve_start
from psarch.checkpoint.writer import checkpoint_step
from psarch.config import Config, ConfigError, from_dict
from psarch.config.faults import KILL, PAUSE, SHRINK, Fault, faults, shrunk
from psarch.cluster.device import dilation
from psarch.launch import outputs
from psarch.dist import under_torchrun
from psarch.errors import RunError
from psarch.launch.stalls import stopped
from psarch.launch.worlds import since
from psarch.records import StepRecord, Summary


class Struck(TypedDict, total=False):
    """summary.json's `faults[]`: what was injected, at which step, when (seconds since the workers started,
    in the cluster's time); a pause's end."""

    node: str
    action: str
    step: int
    signal: str
    at_s: float
    at_unix: float        # when, as time.time() (what other processes' wall clocks compare with)
    seconds: float
    resumed_at_s: float


class Restart(TypedDict):
    """summary.json's `restarts[]`: a world started again (faults.restart): why (the error's first line), when the
    launcher found the world stopped and when it started the next (as Struck's at_s), from which checkpoint step,
    the steps done past it, to be done again, the kills struck by then (all worlds') and the new world's size (N
    with "replace", one less than the world before with "shrink")."""

    error: str
    stopped_at_s: float | None
    at_s: float
    from_step: int
    steps_lost: int
    kills: int
    world_size: int


def kills(struck: list[Struck]) -> int:
    """The kills struck so far."""
    return sum(s["action"] == KILL for s in struck)


def restarts_due(cfg: Config, struck: list[Struck], restarts: list[Restart]) -> bool:
    """Whether a world that just stopped is to start again: faults.restart is "replace" or "shrink", and a kill
    struck since the last start (a failure no kill explains stops the run, however many worlds a kill ended
    before)."""
    return cfg.faults.restart != "none" and kills(struck) > (restarts[-1]["kills"] if restarts else 0)


def not_struck(cfg: Config, struck: list[Struck]) -> Config:
    """cfg with only the faults that have not struck: a restarted world must not strike them again; with
    faults.restart = "shrink", at one rank fewer (each kill ends a world: psarch/config/faults.py)."""
    done = {(s["node"], s["action"], s["step"]) for s in struck}

    def gone(action: str, e: dict) -> bool:
        return (e["node"], action, e["step"]) in done
    if cfg.faults.restart == SHRINK:
        return shrunk(cfg, gone)
    data = cfg.to_dict()
    for action in (KILL, PAUSE):
        data["faults"][action] = [e for e in data["faults"][action] if not gone(action, e)]
    return from_dict(data)


def at_world(cfg: Config, n: int) -> Config:
    """The run's config as its last world ran it, at world size `n`: what a finished run is reported under (a
    shrunk run's summary, predictions and report describe the ranks that finished it; restarts[] says when it
    shrank; config.json keeps the config as asked). Its faults, all struck, are left out."""
    if n == cfg.backend.world_size:
        return cfg
    return shrunk(cfg, lambda action, e: True, n)


def steps_done(out: Path, world: int) -> int:
    """The furthest any worker got: the step after its last streamed one (the run's progress when it stopped)."""
    return max(_next_step(out, r) for r in range(world))


class Injector:
    """Strikes a run's faults on its worker processes and `service_pid(i)`'s servers; `tick()` from the
    launcher's watch loop, `struck` for the summary."""

    def __init__(self, cfg: Config, workers: list, service_pid: Callable[[int], int | None], out: Path,
                 struck: list[Struck], t0: float) -> None:
        """struck: where each fault struck is recorded (the launcher's, for the summary); t0: when the run's
        first workers started (time.monotonic())."""
        self.workers, self.service_pid, self.out, self.struck, self.t0 = workers, service_pid, out, struck, t0
        self.todo: list[Fault] = faults(cfg)
        self.d = dilation(cfg)
        self.resume_at: list[tuple[float, int, Struck]] = []    # (when, pid, its record) of paused nodes

    def pending(self) -> bool:
        return bool(self.todo or self.resume_at)

    def tick(self) -> None:
        """Strike every fault whose worker holds at its step; continue the pauses that are over."""
        now = time.monotonic()
        for when, pid, rec in [r for r in self.resume_at if r[0] <= now]:
            self.resume_at.remove((when, pid, rec))
            _signal(pid, signal.SIGCONT)
            rec["resumed_at_s"] = self._since(time.monotonic())
        for anchor in sorted({f.anchor for f in self.todo}):
            step = min(f.step for f in self.todo if f.anchor == anchor)
            p = self.workers[anchor]
            if p.exitcode is None and stopped(p.pid) and _next_step(self.out, anchor) >= step:
                self._strike(anchor, [f for f in self.todo if (f.anchor, f.step) == (anchor, step)])

    def _strike(self, anchor: int, due: list[Fault]) -> None:
        held = self.workers[anchor].pid
        for f in due:
            self.todo.remove(f)
            pid = held if f.role == "worker" else self.service_pid(f.index)
            if pid is None:
                continue   # refused by the config's checks: a server this launcher did not start
            sig = signal.SIGKILL if f.action == KILL else signal.SIGSTOP
            if pid != held or f.action == KILL:   # the holding worker is stopped already
                _signal(pid, sig)
            rec: Struck = {"node": f.node, "action": f.action, "step": f.step, "signal": sig.name,
                           "at_s": self._since(time.monotonic()), "at_unix": time.time()}
            if f.action != KILL:
                rec["seconds"] = f.seconds
                self.resume_at.append((time.monotonic() + f.seconds * self.d, pid, rec))
            self.struck.append(rec)
        if not any(f.role == "worker" for f in due):   # the worker held only to time a server's fault
            _signal(held, signal.SIGCONT)

    def _since(self, t: float) -> float:
        return since(self.t0, t, self.d)

    def release(self) -> None:
        """Continue every paused node and every worker still holding for a fault (the run ends or stops: nothing
        may stay stopped, where SIGTERM would wait)."""
        for _, pid, rec in self.resume_at:
            _signal(pid, signal.SIGCONT)
            rec["resumed_at_s"] = self._since(time.monotonic())
        self.resume_at = []
        for f in self.todo:
            p = self.workers[f.anchor]
            if p.pid is not None and p.exitcode is None and stopped(p.pid):
                _signal(p.pid, signal.SIGCONT)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:   # it ended meanwhile: nothing left to strike
        pass


def _next_step(out: Path, rank: int) -> int:
    """The step worker `rank` goes on from, by its metrics stream: its last complete line's step + 1 (0 before
    any). Not the count of its lines: a re-admitted PS worker skips the rounds that went on without it."""
    try:
        data = outputs.stream_path(out, rank).read_bytes()
    except OSError:
        return 0
    end = data.rfind(b"\n")
    return 0 if end < 0 else json.loads(data[data.rfind(b"\n", 0, end) + 1:end])["step"] + 1


def check_faults(cfg: Config, resume: bool) -> None:
    """[faults] strike processes this launcher started, once: not under torchrun, not again in a resume."""
    if not faults(cfg):
        return
    if under_torchrun():
        raise ConfigError("faults: injected by `psarch run`'s launcher, which torchrun replaces; run the config "
                          "with `psarch run`, or remove [faults]")
    if resume:
        raise ConfigError("--resume: this run injects [faults] at named steps, which a resume would strike again; "
                          "resume it without them (--set faults.kill=[] --set faults.pause=[])")


def restart_world(out: Path, cfg: Config, ranks_cfg: Config, faulted: Summary, restarts: list[Restart],
                  error: RunError, t0: float, echo: bool) -> tuple[Config, Path | None]:
    """The config and starting checkpoint of a world started again after `error` (cfg: the run's, as asked;
    ranks_cfg: the stopped world's, as its ranks ran it),
    from the newest complete checkpoint in the run folder (step 0 where there is none), with only the faults that
    have not struck, at the same N or, with faults.restart = "shrink", at N - 1; recorded in `restarts` and said on
    stdout (`echo`)."""
    again = not_struck(ranks_cfg, faulted["faults"])
    world, n = ranks_cfg.backend.world_size, again.backend.world_size
    done = steps_done(out, world)
    begin = None
    if latest_complete(out / CHECKPOINTS):
        again, begin = resolve_start(again, out, True, None, echo=False, shrinks=n < world)
    step = checkpoint_step(begin) if begin is not None else 0
    dropped = _dropped_rows(out, begin, n, step)
    outputs.prepare(out, cfg, keep_checkpoints=True)   # the stopped world's streams and errors go
    for r, rows in dropped.items():   # the history of ranks the shrunk world has not, up to its checkpoint
        outputs.stream_path(out, r).write_text("".join(json.dumps(x) + "\n" for x in rows))
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    restarts.append({"error": first, "stopped_at_s": faulted.pop("stopped_at_s", None),
                     "at_s": since(t0, time.monotonic(), dilation(ranks_cfg)), "from_step": step,
                     "steps_lost": done - step, "kills": kills(faulted["faults"]), "world_size": n})
    if echo:
        print(f"psarch: {first}; restarting the world from step {step} at N = {n} (faults.restart = "
              f"\"{ranks_cfg.faults.restart}\")", flush=True)
    return again, begin


def _dropped_rows(out: Path, begin: Path | None, n: int, step: int) -> dict[int, list[StepRecord]]:
    """The step records before `step` of every rank >= n (those a shrunk world of n ranks drops): from the
    checkpoint it starts from where that holds them (a rank of the world that wrote it), else from the stream the
    launcher kept for it at an earlier shrink."""
    rows: dict[int, list[StepRecord]] = {}
    for path in (out / outputs.RANKS_DIR).glob("rank*.jsonl"):
        r = int(path.stem[4:])
        if r >= n:
            rows[r] = [x for x in map(json.loads, path.read_text().splitlines()) if x["step"] < step]
    if begin is not None:
        for path in begin.glob("steps*.jsonl"):
            r = int(path.stem[5:])
            if r >= n:
                rows[r] = [json.loads(x) for x in path.read_text().splitlines()]
    return {r: x for r, x in rows.items() if x}
