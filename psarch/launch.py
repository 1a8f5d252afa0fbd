"""Start every rank of a run: spawned on this machine (`psarch run`), or one rank under torchrun.

A rank that fails stops the whole run with that rank's error; nothing is left running."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from psarch import outputs
from psarch.checkpoint.start import CHECKPOINTS, starting_checkpoint
from psarch.cluster import Placement, place
from psarch.cluster.window import StepMarks
from psarch.config import Config, ConfigError, check_machine, from_dict
from psarch.dist import init_rank, shutdown, under_torchrun
from psarch.errors import NON_FINITE_EXIT, NonFiniteError, RunError
from psarch.lifecycle import die_with_parent
from psarch.registry import trainer_class
from psarch.runner import run_rank
from psarch.workload import Workload, build_workload


ECHO_GRACE_S = 2.0  # how long the launcher waits, after a rank fails, for its peers' errors before it names one


def run(cfg: Config, out: str | Path | None = None, echo: bool = True, resume: bool = False,
        start: str | Path | None = None, machine_checked: bool = False) -> dict[str, Any]:
    """Run one experiment and return its summary. Every rank (and service) is started here. With `resume`,
    continue the run in `out` from its latest complete checkpoint; with `start`, begin from that checkpoint.
    machine_checked: the caller already ran check_machine(cfg) (a sweep checks every point before the first)."""
    if cfg.cluster.emulate and under_torchrun():
        raise ConfigError("cluster.emulate = true: not under torchrun, whose machines are the cluster; "
                          "use `psarch run`, or --set cluster.emulate=false")
    if not machine_checked:  # once per run: with cluster.emulate it creates and deletes a probe namespace
        check_machine(cfg)  # a missing GPU or text file: one ConfigError now, not a traceback in every rank
    out_dir = outputs.run_folder(cfg, out)
    cls = trainer_class(cfg.backend.kind)
    if (cfg.train.checkpoint_every or resume or start is not None) and not cls.checkpoints:
        raise ConfigError(f"backend.kind = {cfg.backend.kind!r} cannot write or read checkpoints yet "
                          f"(train.checkpoint_every, --resume, --from)")
    ckpt = starting_checkpoint(cfg, out_dir, resume, start)  # verified before anything is written or started
    plan = _Plan(out_dir / CHECKPOINTS if cfg.train.checkpoint_every else None,
                 ckpt.path if ckpt is not None else None, resume)
    if under_torchrun():
        return _run_under_torchrun(cfg, cls, out_dir, echo, plan)
    # A user's factory runs here once (no process group yet), so a wrong return type is one ConfigError
    # before any rank starts; a single in-process rank then trains this very workload.
    workload = build_workload(cfg) if cfg.workload.factory else None
    outputs.prepare(out_dir, cfg, keep_checkpoints=resume)   # a fork must not keep an older run's
    try:
        with place(cfg) as where:   # loopback, or each process on its node of an emulated cluster
            services = cls.start_services(cfg, out_dir, where, start=plan.start)
            try:
                info = services.info if services is not None else {}
                if cfg.backend.world_size == 1:
                    marks = where.step_marks(1)   # outside the node: the counters' reader is no node's
                    with where.node("worker", 0):
                        _run_in_process(cfg, cls, out_dir, info, echo, plan, workload, marks)
                else:
                    _spawn(cfg, cls, out_dir, info, echo, services, plan, where)
                extra = services.finish() if services is not None else None
            finally:
                if services is not None:
                    services.stop()
            cluster = where.report()
    except BaseException as e:  # failed or interrupted (Ctrl-C, SIGTERM): keep the finished steps, say why
        _keep_finished_steps(out_dir, cfg, e)
        raise
    return outputs.finalize(out_dir, cfg, dict(extra or {}, **({"cluster": cluster} if cluster else {})), echo)


@dataclass(frozen=True)
class _Plan:
    """Where ranks write checkpoints (None: nowhere), the checkpoint they start from (None: step 0), and
    whether that start resumes the run (its metric rows carried on) or forks it."""

    checkpoints: Path | None
    start: Path | None
    resume: bool

    def kwargs(self) -> dict[str, Any]:
        return {"checkpoints": self.checkpoints, "start": self.start, "resume": self.resume}


def _keep_finished_steps(out: Path, cfg: Config, e: BaseException) -> None:
    status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
    error = str(e) if isinstance(e, RunError) else f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    try:
        outputs.finalize_stopped(out, cfg, status, error)
    except Exception as w:  # never hide the run's own error behind this one
        print(f"psarch: could not write the {status} run's summary: {type(w).__name__}: {w}", file=sys.stderr)


def _threads(world: int) -> int:
    env = os.environ.get("PSARCH_THREADS")
    return int(env) if env else max(1, (os.cpu_count() or 1) // world)


def _run_in_process(cfg: Config, cls: type, out: Path, info: dict, echo: bool, plan: _Plan,
                    workload: Workload | None, marks: StepMarks | None) -> None:
    store = None
    if cls.needs_process_group:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=cfg.backend.timeout_s))
    ctx = init_rank(cfg, 0, 1, 0, 1, store, needs_group=store is not None)
    ctx.services = info
    try:
        outputs.save_record(out, run_rank(cfg, ctx, workload, echo=echo, metrics=outputs.stream_path(out, 0),
                                          marks=marks, **plan.kwargs()))
    finally:
        shutdown(ctx)


def _rank_main(cfg_dict: dict, rank: int, world: int, host: str, port: int, out: str, info: dict, threads: int,
               needs_group: bool, echo: bool, plan: _Plan, marks: StepMarks | None) -> None:
    die_with_parent()
    out_dir = Path(out)
    try:
        torch.set_num_threads(threads)
        cfg = from_dict(cfg_dict)
        store = dist.TCPStore(host, port, world, is_master=False,
                              timeout=timedelta(seconds=cfg.backend.timeout_s)) if needs_group else None
        ctx = init_rank(cfg, rank, world, rank, world, store, needs_group=needs_group)
        ctx.services = info
        outputs.save_record(out_dir, run_rank(cfg, ctx, echo=echo, metrics=outputs.stream_path(out_dir, rank),
                                              marks=marks, **plan.kwargs()))
        shutdown(ctx)
    except BaseException as e:  # report every failure, KeyboardInterrupt included, then exit non-zero
        _write_error(out_dir, rank, e)
        sys.stdout.flush()
        os._exit(NON_FINITE_EXIT if isinstance(e, NonFiniteError) else 1)


def _write_error(out: Path, rank: int, e: BaseException) -> None:
    """The rank's error record. `failed_at_ns` is CLOCK_MONOTONIC, one clock for every process of this
    machine, fine enough to order a failure before the peers' echoes of it (file mtimes are not)."""
    (out / outputs.RANKS_DIR / f"rank{rank}.error").write_text(json.dumps(
        {"rank": rank, "error": f"{type(e).__name__}: {e}".splitlines()[0], "failed_at_ns": time.monotonic_ns(),
         "traceback": traceback.format_exc()}, indent=1) + "\n")


def _read_error(out: Path, rank: int) -> dict[str, Any] | None:
    try:
        return json.loads((out / outputs.RANKS_DIR / f"rank{rank}.error").read_text())
    except (OSError, ValueError):
        return None


# How a peer's failure reaches a rank that did nothing wrong: its sockets close, its collectives time out.
_PEER_ECHOES = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
                "end of file", "socket timeout", "timed out", "timeout", "distnetworkerror", "distbackenderror",
                "gloo", "tcpstore")


def _root_cause(out: Path, failed: dict[int, int]) -> int:
    """Of several failed ranks ({rank: exit code}), the one whose error caused the others': a non-finite
    loss (in ddp/zero the all-reduce spreads it), then an error that is not a peer's echo, then the
    earliest; among those, a rank that left no record (killed) comes first."""
    def key(rank: int) -> tuple[bool, bool, int]:
        rec = _read_error(out, rank)
        echo = rec is not None and any(e in rec["error"].lower() for e in _PEER_ECHOES)
        return (failed[rank] != NON_FINITE_EXIT, echo, rec["failed_at_ns"] if rec is not None else -1)
    return min(failed, key=key)


def _spawn(cfg: Config, cls: type, out: Path, info: dict, echo: bool, services: Any, plan: _Plan,
           where: Placement) -> None:
    n = cfg.backend.world_size
    needs_group = cls.needs_process_group
    store = None
    if needs_group:
        with where.rendezvous():
            store = dist.TCPStore(where.rendezvous_host, 0, n + 1, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=cfg.backend.timeout_s))
    port = store.port if store is not None else 0
    ctx = mp.get_context("spawn")
    marks = where.step_marks(n)   # an emulated cluster reads its links before the first step and after the last
    procs = [ctx.Process(target=_rank_main, name=f"psarch-rank{r}",
                         args=(cfg.to_dict(), r, n, where.rendezvous_host, port, str(out), info, _threads(n),
                               needs_group, echo, plan, marks))
             for r in range(n)]
    tolerant = cls.tolerates_lost_workers(cfg) and services is not None
    try:
        for r, p in enumerate(procs):
            with where.node("worker", r):
                p.start()
        alive = list(procs)
        while alive:
            wait([p.sentinel for p in alive], timeout=0.5)
            failed = _reap(alive, procs)
            if failed and tolerant and all(procs[r].exitcode != NON_FINITE_EXIT for r in failed):
                for r in failed:   # a poisoned worker is never a lost one: the run cannot go on without it
                    services.worker_lost(r, _rank_error(out, r, procs[r].exitcode))
                where.worker_lost()
            elif failed:
                # its peers fail moments later ("connection reset by peer"): let them, then name the cause
                deadline = time.monotonic() + ECHO_GRACE_S
                while alive and time.monotonic() < deadline:
                    wait([p.sentinel for p in alive], timeout=max(0.0, deadline - time.monotonic()))
                    failed += _reap(alive, procs)
                first = _root_cause(out, {r: procs[r].exitcode for r in failed})
                raise RunError(_rank_error(out, first, procs[first].exitcode))
            if services is not None:
                services.check()
    finally:
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


def _rank_error(out: Path, rank: int, code: int | None) -> str:
    rec = _read_error(out, rank)
    if rec is not None:
        return f"rank {rank} failed: {rec['error']}\n{rec['traceback']}"
    return f"rank {rank} exited with code {code} (killed: out of memory, or a signal?)"


def _run_under_torchrun(cfg: Config, cls: type, out: Path, echo: bool, plan: _Plan) -> dict[str, Any]:
    """One rank of a torchrun job. Services (the parameter servers of `ps` without
    backend.server_addresses) are started by rank 0, which is also worker 0, as `psarch run` starts
    them; their addresses reach every rank as JSON over the process group (no pickle) before any
    trainer is built. A rank that fails prints its error and exits at once: a barrier here would
    only wait for peers stuck in a collective and replace the error with its own timeout."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != cfg.backend.world_size:
        raise RunError(f"backend.world_size = {cfg.backend.world_size}: torchrun started WORLD_SIZE = {world} ranks")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    services = None
    try:
        if rank == 0:
            outputs.prepare(out, cfg, keep_checkpoints=plan.resume)
        ctx = init_rank(cfg, rank, world, local_rank, local_world, None, launched_by="torchrun",
                        needs_group=True)
        # every rank takes part in the gather: only rank 0 knows whether the backend started services
        info: dict[str, Any] = {}
        if rank == 0:
            services = cls.start_services(cfg, out, start=plan.start)
            info = dict(services.info) if services is not None else {}
            if "addresses" in info:
                info["addresses"] = [_reachable(a) for a in info["addresses"]]
        ctx.services = _gather_json(ctx, info)[0]
        # ranks on other machines stream only where the run folder is shared (rank 0 made it before init_rank)
        stream = outputs.stream_path(out, rank) if (out / outputs.RANKS_DIR).is_dir() else None
        record = run_rank(cfg, ctx, echo=echo, metrics=stream, **plan.kwargs())
        state = record.pop("model_state", None)
        records = _gather_json(ctx, record)   # every rank is done with the servers past this point
        extra = None
        if rank == 0:
            outputs.save_record(out, dict(records[0], model_state=state))
            for r in records[1:]:
                outputs.save_record(out, r)
            if services is not None:
                extra = services.finish()   # the servers' measurements; model.pt from their parameters
                services.stop()
                services = None
    except BaseException as e:  # say why, then leave without the teardown barrier (torchrun stops the peers)
        if rank == 0 and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)   # torchrun's stop for the peers must not cut this short
        print(f"rank {rank} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if rank == 0 and (out / outputs.RANKS_DIR).is_dir():   # the steps streamed so far, as `psarch run` keeps them
            _keep_finished_steps(out, cfg, e)
        if services is not None:
            services.stop()
        sys.stdout.flush()
        os._exit(1)
    shutdown(ctx)
    return outputs.finalize(out, cfg, extra, echo) if rank == 0 else {}


def _reachable(address: str) -> str:
    """A server bound to every interface (backend.host = 0.0.0.0) is reached at rank 0's host, which
    torchrun names in MASTER_ADDR."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    return f"{scheme}://{os.environ['MASTER_ADDR']}:{port}" if host in ("0.0.0.0", "*") else address


def _gather_json(ctx: Any, obj: dict) -> list[dict]:
    """Every rank's JSON-able dict, on every rank (JSON over all_gather: no pickle on the wire)."""
    dev = ctx.device if ctx.dist_backend == "nccl" else torch.device("cpu")
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[:data.numel()] = data
    bufs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(ctx.world_size)]
    dist.all_gather(bufs, padded)
    return [json.loads(bytes(b[:int(s.item())].cpu().numpy())) for b, s in zip(bufs, sizes)]
