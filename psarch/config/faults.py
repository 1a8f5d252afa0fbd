"""The [faults] section: failures `psarch run`'s launcher injects at named steps (psarch/launch/faults.py), and
the checks that refuse a fault no run could meet, before any process starts.

A fault is timed by a worker's step: `{ node = "worker 2", step = 30 }` strikes worker 2 as it begins step 30
(steps 0..29 done); a server's fault strikes as worker 0 begins that step. The worker holds itself there
(SIGSTOP on itself) so the launcher strikes at exactly that step, whatever the step time: a faulted run is
repeatable.

faults.restart = "shrink" restarts a collective world at N - 1 after a kill, as torchrun's elastic agent does when
a node does not come back: the survivors renumbered 0..N-2 (a later fault names a rank of the world it strikes
in), the global batch kept (train.global_batch, which must divide by N - 1: every step's batch is the same, cut
in N - 1 shards instead of N, so the shrunk world sees exactly the data the full one would), the state read from
the newest checkpoint at N - 1 (ZeRO's shards resharded). Refused before anything starts where it cannot work:
a layout cut by the world size (pipeline, tensor), a global batch N - 1 does not divide, two faults at a kill's
step.

faults.startup_s paces each world's start-up as the cluster's, as a virtual device paces its compute
(psarch/cluster/startup.py): the restart's start-up is then an input, the cluster's, not this host's / D.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from psarch.config.fields import option
from psarch.errors import ConfigError, show

if TYPE_CHECKING:
    from psarch.config import Config

KILL, PAUSE = "kill", "pause"
SHRINK = "shrink"   # faults.restart: the world restarted at N - 1
_KEYS = {KILL: ("node", "step"), PAUSE: ("node", "step", "seconds")}


@dataclass
class FaultsConfig:
    """Failures injected by `psarch run`'s launcher at named steps, recorded in summary.json."""

    kill: list = option([], "nodes killed (SIGKILL) as a step begins, e.g. [{ node = \"worker 2\", step = 30 }, "
                            "{ node = \"server 1\", step = 50 }]; a server's step is worker 0's")
    pause: list = option([], "nodes stopped (SIGSTOP) as a step begins, continued (SIGCONT) `seconds` later (the "
                             "cluster's time), e.g. [{ node = \"worker 1\", step = 20, seconds = 5 }]")
    restart: str = option("none", "what the launcher does when a killed node stops the run: 'replace' starts the "
                                  "world again, at the same N, from the newest complete checkpoint in the run folder "
                                  "(train.checkpoint_every), as torchrun's elastic agent does; 'shrink' starts it at "
                                  "N - 1 (ranks renumbered 0..N-2), the global batch kept and cut in N - 1 shards",
                          choices=("none", "replace", "shrink"))
    startup_s: float = option(0.0, "the cluster's time from a world's launch to its first step (seconds): every world, the "
                                   "first and each restarted one, holds its first step until its launch + startup_s x "
                                   "cluster.dilation of wall clock (a world whose ranks arrive later is reported as a "
                                   "start-up overrun), and failure costs predict a restart's start-up as this; 0: the "
                                   "host's own start-up / D, predicted by the first world's. Needs virtual devices on "
                                   "an emulated cluster", min=0.0)


@dataclass(frozen=True)
class Fault:
    """One fault: `action` (kill, pause) on node (`role` "worker" or "server", `index`) as `step` begins on
    worker `anchor` (the worker itself, or worker 0 for a server); `seconds` of a pause."""

    action: str
    role: str
    index: int
    step: int
    seconds: float = 0.0

    @property
    def node(self) -> str:
        return f"{self.role} {self.index}"

    @property
    def anchor(self) -> int:
        return self.index if self.role == "worker" else 0


def faults(cfg: Config) -> list[Fault]:
    """The config's faults in the order they strike (step, then as listed), checked (ConfigError otherwise)."""
    out = [_parse(cfg, action, i, entry) for action in (KILL, PAUSE)
           for i, entry in enumerate(getattr(cfg.faults, action))]
    out.sort(key=lambda f: f.step)
    _check_together(cfg, out)
    _check_restart(cfg)
    return out


def holds(cfg: Config, rank: int) -> list[int]:
    """The steps at which worker `rank` holds itself (SIGSTOP) for the launcher to strike, in order."""
    return sorted({f.step for f in faults(cfg) if f.anchor == rank})


def _parse(cfg: Config, action: str, i: int, entry: Any) -> Fault:
    key, keys = f"faults.{action}[{i}]", _KEYS[action]
    example = "{ node = \"worker 1\", step = 10" + (", seconds = 5 }" if action == PAUSE else " }")
    if not isinstance(entry, dict) or set(entry) != set(keys):
        raise ConfigError(f"{key} = {show(entry)}: expected a table with {', '.join(keys)}, e.g. {example}")
    role, _, index = str(entry["node"]).partition(" ")
    n, servers = cfg.backend.world_size, _servers(cfg)
    if role not in ("worker", "server") or not index.isdigit():
        raise ConfigError(f"{key}.node = {show(entry['node'])}: expected \"worker I\" or \"server I\"")
    if role == "worker" and int(index) >= n:
        raise ConfigError(f"{key}.node = {show(entry['node'])}: unknown node; workers are 0..{n - 1} "
                          f"(backend.world_size = {n})")
    if role == "server" and int(index) >= servers:
        raise ConfigError(f"{key}.node = {show(entry['node'])}: unknown node; " + (
            f"servers are 0..{servers - 1} (backend.servers = {servers})" if servers else
            f"backend.kind = {show(cfg.backend.kind)} runs no server that `psarch run` starts"))
    step = entry["step"]
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < cfg.train.steps:
        raise ConfigError(f"{key}.step = {show(step)}: expected a step in 0..{cfg.train.steps - 1} "
                          f"(train.steps = {cfg.train.steps}; step S strikes as step S begins)")
    seconds = entry.get("seconds", 0.0)
    if action == PAUSE and (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
                            or not math.isfinite(seconds) or seconds <= 0):
        raise ConfigError(f"{key}.seconds = {show(seconds)}: expected a number of seconds > 0")
    return Fault(action, role, int(index), step, float(seconds))


def check_startup(cfg: Config) -> None:
    """faults.startup_s is the cluster's time: it needs the virtual devices and the dilation of an emulated cluster."""
    from psarch.cluster import device
    if cfg.faults.startup_s and not (device.modelled(cfg) and cfg.cluster.emulate):
        raise ConfigError(f"faults.startup_s = {cfg.faults.startup_s:g}: paces a world's start-up as the cluster's, "
                          f"which needs virtual devices on an emulated cluster (cluster.emulate = true and a modelled "
                          f"cluster.device or cluster.device_tflops); remove it, or set faults.startup_s = 0")


def _servers(cfg: Config) -> int:
    from psarch import registry
    return registry.spec_of(cfg).service_nodes(cfg)


def _check_restart(cfg: Config) -> None:
    from psarch import registry
    spec = registry.spec_of(cfg)
    if cfg.faults.restart == "none":
        return
    this = f"faults.restart = {show(cfg.faults.restart)}"
    if spec.tolerates_lost_workers(cfg):
        raise ConfigError(f"{this}: backend.kind = {show(cfg.backend.kind)} goes on without a dead worker; "
                          f"a restart is for backends that stop (collectives)")
    if not spec.checkpoints or not cfg.train.checkpoint_every:
        raise ConfigError(f"{this}: restarts from the newest checkpoint, so it needs train.checkpoint_every > 0"
                          + ("" if spec.checkpoints else f" and a backend that writes checkpoints (not "
                                                         f"{show(cfg.backend.kind)})"))


def shrunk(cfg: Config, struck: Callable[[str, dict], bool], n: int | None = None) -> Config:
    """The config of the world restarted at N - 1 (or `n`) after a kill (faults.restart = "shrink"): the same run,
    global batch and options at that backend.world_size, with only the faults not `struck(action, entry)`. Checked
    as every config is, before the run starts (psarch.config.rules)."""
    size = cfg.backend.world_size - 1 if n is None else n
    f = cfg.faults
    return dataclasses.replace(cfg, backend=dataclasses.replace(cfg.backend, world_size=size),
                               faults=dataclasses.replace(f, kill=[e for e in f.kill if not struck(KILL, e)],
                                                          pause=[e for e in f.pause if not struck(PAUSE, e)]))


def _processes(cfg: Config) -> int:
    from psarch import registry
    return registry.spec_of(cfg).processes(cfg)


def _check_together(cfg: Config, faults: list[Fault]) -> None:
    """What no list of valid faults may hold: a node struck after it was killed, a worker that runs in the
    launcher's own process (world size 1) to time them, a server's fault timed by worker 0 killed before it."""
    killed: dict[str, int] = {}
    worker0 = min((f.step for f in faults if f.action == KILL and f.node == "worker 0"), default=None)
    for f in faults:
        if f.node in killed and cfg.faults.restart != SHRINK:   # a shrunk world's "worker i" is another rank
            raise ConfigError(f"faults.{f.action}: {f.node} at step {f.step}: it was killed at step {killed[f.node]}")
        if _processes(cfg) == 1:   # the worker that times every fault would stop the launcher
            why = ("a single worker runs" if cfg.backend.world_size == 1 else
                   f"backend.kind = {show(cfg.backend.kind)} runs its {cfg.backend.world_size} workers as threads")
            raise ConfigError(f"faults.{f.action}: {f.node}: {why} in the launcher's own process, which cannot hold "
                              f"itself for a fault; faults need workers in processes of their own")
        if f.role == "server" and worker0 is not None and worker0 < f.step:
            raise ConfigError(f"faults.{f.action}: {f.node} at step {f.step}: a server's fault is timed by worker 0, "
                              f"killed at step {worker0}")
        if f.action == KILL:
            killed[f.node] = f.step
