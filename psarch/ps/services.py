"""Start the parameter servers of a local run, watch them, gather what they measured, stop them.

The launcher calls `start_services(cfg, out_dir)` before it starts the workers and hands `services.info` (a
psarch.records.ServiceInfo: addresses, credentials) to every rank. Each server is a process of its own
(psarch.launch.processes; or, for tests, a thread) that talks to the launcher over a pipe carrying JSON and raw
bytes only (no pickle):
"ready"/"failed"/"stats" events one way, "lost"/"stats"/"stop" commands the other. `check()` raises
when a server failed (e.g. a sync timeout naming the missing worker) or died; `finish()` returns the
servers' traffic, memory and staleness for summary.json and writes model.pt from the servers' final
parameters (servers_outputs.py); `stop()` always ends every server.

With `backend.server_addresses` set, the servers were started elsewhere (`psarch server`): nothing is
started or stopped here, and the summary has only what the workers measured.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from psarch.checkpoint.finetune import starts_from_base
from psarch.checkpoint.start import CHECKPOINTS
from psarch.cluster.placement import Loopback, Placement
from psarch.config import Config, ConfigError, from_dict
from psarch.launch import processes
from psarch.launch.lifecycle import die_with_parent
from psarch.ps.auth import KEYGEN_HINT, AuthError, Credentials, check_folder, mechanism, remove, run_credentials
from psarch.ps.errors import ServiceError
from psarch.ps.partitions import replicas
from psarch.ps.replication import bytes_summary, death, survivors
from psarch.ps.servers_outputs import write_outputs
from psarch.ps.servers_summary import summarize
from psarch.records import LostWorker, ServiceInfo, Summary
from psarch.trainer import Services

if TYPE_CHECKING:
    from psarch.ps.server.stats import Command, ServerStats

START_TIMEOUT_S = 120.0


def _server_main(index: int, cfg_dict: dict, host: str, conn: Any, threads: int | None, build: bool,
                 creds: dict, checkpoints: str | None = None, start: str | None = None) -> None:
    """Entry point of one server (process or thread): `checkpoints`, the folder its saves go to; `start`, the
    checkpoint it starts from."""
    if threads is not None:  # a process of its own: it must not outlive the launcher
        die_with_parent()
    server = None
    try:
        if threads:
            torch.set_num_threads(threads)
        from psarch.ps.server.start import build_server
        server = build_server(index, from_dict(cfg_dict), host, 0, build, pipe=conn,
                              creds=Credentials.from_dict(creds), checkpoints=checkpoints)
        # the launcher verified it (metadata, model); the hybrid's servers (rows, no dense range) restore their rows
        if start is not None and (server.state.initialised or server.rows is not None):
            from psarch.checkpoint import Checkpoint
            ckpt = Checkpoint(start)
            server.snapshots.restore(ckpt)
            ckpt.close()
        conn.send_bytes(json.dumps({"event": "ready", "address": server.address}).encode())
        server.serve()
    except BaseException as e:  # report, never hang the launcher
        try:
            conn.send_bytes(json.dumps({"event": "failed", "server": index,
                                        "message": f"server {index} crashed: {type(e).__name__}: {e}\n"
                                                   f"{traceback.format_exc()}"}).encode())
        except OSError:
            pass
        if threads is not None:  # a process: exit non-zero
            os._exit(1)


class LocalServers(Services):
    """S servers on this machine, one process each (threads=True: threads of this process, for tests)."""

    def __init__(self, cfg: Config, out_dir: str | Path | None = None, threads: bool = False,
                 build_model: bool = True, where: Placement | None = None, start: str | Path | None = None) -> None:
        self.cfg, self.out_dir = cfg, Path(out_dir) if out_dir is not None else None
        # a server writes checkpoints only under its run's folder, and only when the run writes them
        ckpts = str(self.out_dir / CHECKPOINTS) if self.out_dir is not None and cfg.train.checkpoint_every else None
        # a fine-tune --from a base model's checkpoint: the servers build their range from it (layout.initial_flat)
        # as a run from step 0 does from the seed, and the workers pull it; any other checkpoint is restored
        begin = str(start) if start is not None and not starts_from_base(cfg, Path(start)) else None
        if begin is not None and replicas(cfg):
            raise ConfigError(f"backend.replicas = {replicas(cfg)}: a run started from a checkpoint (--resume, --from) "
                              f"has no replicas to start from yet; run it with backend.replicas = 0 (a fine-tune from "
                              f"a base model's checkpoint builds them)")
        self.lost: list[LostWorker] = []
        self.failure: str | None = None
        self.stopped_since: dict[int, float] = {}
        self.dead: dict[int, str] = {}   # backend.replicas: servers that died while their partitions live on
        self.conns, self.workers = [], []
        where = where or Loopback()   # an emulated cluster puts each server on its own node
        ctx = where.context()
        # backend.host, not a node's address: an emulated cluster's network exists only inside this run's
        # namespaces, as private as loopback, so auth = "auto" keeps PLAIN there.
        # The folder's path travels (spawn args, services info), never a secret: each process reads its own
        creds, self.tmp_keys = run_credentials(cfg, cfg.backend.host)
        try:
            for i in range(cfg.backend.servers):
                parent, child = mp.Pipe()
                host = where.host("server", i, cfg.backend.host)
                if threads:
                    w: Any = threading.Thread(target=_server_main, name=f"psarch-server{i}", daemon=True,
                                              args=(i, cfg.to_dict(), host, child, None, build_model,
                                                    creds.to_dict(), ckpts, begin))
                else:
                    w = processes.process(ctx, _server_main, (i, cfg.to_dict(), host, child, 1, build_model,
                                                              creds.to_dict(), ckpts, begin), name=f"psarch-server{i}")
                with where.node("server", i):
                    w.start()
                if not threads:
                    child.close()  # the server holds its end: a dead server is then EOF here, and vice versa
                self.conns.append(parent)
                self.workers.append(w)
            addresses = [self._wait_event(i, "ready", START_TIMEOUT_S)["address"] for i in range(len(self.conns))]
        except BaseException:
            self.stop()
            raise
        # restored: the servers start from a checkpoint, so a worker takes its state from it, not a first pull
        self.info = ServiceInfo(addresses, creds.to_dict(), restored=begin is not None)

    def _wait_event(self, i: int, kind: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = (json.loads(self.conns[i].recv_bytes())
                         if self.conns[i].poll(min(0.2, max(0.0, deadline - time.monotonic()))) else None)
            except (EOFError, OSError):
                self.workers[i].join(1)
                raise ServiceError(f"server {i} exited (code {getattr(self.workers[i], 'exitcode', None)}) "
                                   f"before it was {kind}") from None
            if event is not None:
                if event["event"] == kind:
                    return event
                if event["event"] == "failed":
                    self.failure = self.failure or event["message"]
                    raise ServiceError(event["message"])
            elif not self._alive(i):
                raise ServiceError(f"server {i} exited (code {getattr(self.workers[i], 'exitcode', None)}) "
                                   f"before it was {kind}")
            if time.monotonic() > deadline:
                raise ServiceError(f"server {i}: no {kind!r} within {timeout:g} s")

    def _alive(self, i: int) -> bool:
        return self.workers[i].is_alive()

    def _stopped_too_long(self, i: int) -> bool:
        """A stopped server answers no one but is alive: name it once it has been stopped for timeout_s
        (before every worker times out on it and the run ends with only their errors)."""
        w = self.workers[i]
        try:  # Linux: the state letter follows the parenthesised command name; T/t: stopped or traced
            stopped = isinstance(w, mp.process.BaseProcess) and Path(f"/proc/{w.pid}/stat").read_text(
                ).rpartition(")")[2].split()[0] in ("T", "t")
        except (OSError, IndexError):
            stopped = False
        if not stopped:
            self.stopped_since.pop(i, None)
            return False
        since = self.stopped_since.setdefault(i, time.monotonic())
        return time.monotonic() - since > self.cfg.backend.timeout_s

    def pid(self, index: int) -> int | None:
        w = self.workers[index]
        return w.pid if isinstance(w, mp.process.BaseProcess) else None

    def _send(self, i: int, cmd: Command) -> None:
        try:
            self.conns[i].send_bytes(json.dumps(cmd).encode())
        except OSError:
            pass

    def check(self) -> None:
        """Raise ServiceError if a server reported a failure or died."""
        for i, conn in enumerate(self.conns):
            try:
                while conn.poll():
                    event = json.loads(conn.recv_bytes())
                    if event["event"] == "failed":
                        self.failure = self.failure or event["message"]
            except (EOFError, OSError):
                pass  # the pipe closed: the process is gone, found just below
            if self.failure is None and i not in self.dead and not self._alive(i):
                self._died(i, f"server {i} died (exit code {getattr(self.workers[i], 'exitcode', None)})")
            if self.failure is None and i not in self.dead and self._stopped_too_long(i):
                self.failure = (f"server {i} (pid {self.workers[i].pid}) has been stopped (SIGSTOP?) for more than "
                                f"backend.timeout_s = {self.cfg.backend.timeout_s:g} s")
        if self.failure is not None:
            raise ServiceError(self.failure)

    def _died(self, i: int, text: str) -> None:
        """Server i is dead: the run's error (`text`, one line) unless its partitions live on (backend.replicas,
        replication.py), then said on stderr and remembered."""
        k, r = len(self.conns), replicas(self.cfg)
        self.failure = death(k, r, set(self.dead), i, text)
        if self.failure is None:
            self.dead[i] = text
            print(f"psarch: {text}; its partitions are served by server(s) "
                  f"{', '.join(map(str, survivors(k, r, i, set(self.dead))))} (backend.replicas = {r})",
                  file=sys.stderr, flush=True)

    def worker_lost(self, rank: int, error: str) -> None:
        """A worker died in a mode that goes on without it: servers stop waiting for it."""
        self.lost.append({"rank": rank, "error": error.splitlines()[0] if error else ""})
        for i in range(len(self.conns)):
            self._send(i, {"cmd": "lost", "worker": rank})

    def finish(self) -> Summary:
        """Gather every server's measurements (and final parameters, written as model.pt)."""
        self.check()
        stats: list[ServerStats] = []
        parts = []
        for i in range(len(self.conns)):
            got = self._stats(i)
            if got is not None:
                stats.append(got[0])
                parts.append(got[1])
        out = summarize(stats, self.lost)
        out["auth"] = Credentials.from_dict(self.info.auth).mechanism
        if replicas(self.cfg):
            out["replication"] = bytes_summary(self.cfg, [s["traffic"]["ops"] for s in stats], self.dead)
        if self.out_dir is not None:
            live = [i for i in range(len(self.conns)) if i not in self.dead]   # in the order of `parts`
            write_outputs(self.cfg, self.out_dir, out, parts, live)
        return out

    def _stats(self, i: int) -> tuple[ServerStats, torch.Tensor] | None:
        """Server i's measurements and final parameters; None where it is dead (already, or dying now) and its
        partitions live on (backend.replicas); ServiceError where it is the run's end."""
        if i in self.dead:
            return None
        self._send(i, {"cmd": "stats"})
        try:
            s = self._wait_event(i, "stats", START_TIMEOUT_S)
            raw = self.conns[i].recv_bytes()
        except (ServiceError, EOFError, OSError):
            self.workers[i].join(1)
            if not replicas(self.cfg) or self._alive(i):
                raise
            self._died(i, f"server {i} died (exit code {getattr(self.workers[i], 'exitcode', None)})")
            if self.failure is not None:
                raise ServiceError(self.failure) from None
            return None
        s.pop("event")
        return cast("ServerStats", s), torch.frombuffer(bytearray(raw), dtype=torch.float32) if raw else torch.empty(0)

    def stop(self) -> None:
        """End every server: ask, then terminate (processes), then kill; close the pipes."""
        for i in range(len(self.conns)):
            self._send(i, {"cmd": "stop"})
        deadline = time.monotonic() + 5
        for w in self.workers:
            w.join(max(0.1, deadline - time.monotonic()))
        for w in self.workers:
            if isinstance(w, mp.process.BaseProcess) and w.is_alive():
                w.terminate()
                w.join(5)
                if w.is_alive():
                    w.kill()
                    w.join()
        for c in self.conns:
            c.close()
        self.conns = []
        remove(self.tmp_keys)   # per-run credentials end with the run
        self.tmp_keys = None


class RemoteServers(Services):
    """Servers started elsewhere (`psarch server`), listed in backend.server_addresses."""

    def __init__(self, cfg: Config) -> None:
        b = cfg.backend
        host = b.server_addresses[0].partition("://")[2].rpartition(":")[0]
        creds = Credentials(mechanism(b.auth, host), b.keys)
        if creds.mechanism != "none":
            if not b.keys:
                raise AuthError(f"backend.server_addresses: servers started with `psarch server` need "
                                f"backend.keys (backend.auth = {b.auth!r}); {KEYGEN_HINT}")
            check_folder(b.keys, creds.mechanism, b.world_size, b.servers)
        self.info = ServiceInfo(list(b.server_addresses), creds.to_dict())
        self.lost: list[LostWorker] = []

    def check(self) -> None:
        pass

    def worker_lost(self, rank: int, error: str) -> None:
        self.lost.append({"rank": rank, "error": error.splitlines()[0] if error else ""})

    def pid(self, index: int) -> int | None:
        return None

    def finish(self) -> Summary:
        return {"lost_workers": self.lost, "auth": Credentials.from_dict(self.info.auth).mechanism}

    def stop(self) -> None:
        pass


def start_services(cfg: Config, out_dir: str | Path | None = None, threads: bool = False, build_model: bool = True,
                   where: Placement | None = None, start: str | Path | None = None) -> LocalServers | RemoteServers:
    """The servers of a run (build_model=False: servers that wait for an `init`, for benchmarks;
    `where`: the run's placement, psarch.cluster; `start`: the checkpoint they start from)."""
    b = cfg.backend
    if b.server_addresses:
        if start is not None or cfg.train.checkpoint_every:
            raise ConfigError("backend.server_addresses: servers started with `psarch server` have no run folder "
                              "to write or read checkpoints in (train.checkpoint_every, --resume, --from)")
        return RemoteServers(cfg)
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world and local and world != local and not b.keys and mechanism(b.auth, b.host) != "none":
        # torchrun across machines: fresh per-run credentials would exist on this machine only
        raise AuthError(f"torchrun across machines (WORLD_SIZE {world}, LOCAL_WORLD_SIZE {local}): the servers' "
                        f"credentials must be on every machine; {KEYGEN_HINT}")
    return LocalServers(cfg, out_dir, threads, build_model, where, start)
