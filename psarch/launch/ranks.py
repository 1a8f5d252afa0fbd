"""Start every rank of a run: on this machine (`psarch run`: from the placement's context, psarch's forkserver,
psarch.launch.processes, each rank on its node of an emulated cluster; one rank runs in this process), or one rank
under torchrun (psarch.launch.torchrun). Every rank does the same (`_rank`): join the group, train
(psarch.launch.runner), leave its record, leave the group; the services a backend declares (its spec's
start_services) start first. What every rank is given: psarch.launch.job's RankJob.

A rank that fails stops the whole run with that rank's error; nothing is left running (psarch.launch.supervise).
A spawned rank that has written everything leaves with os._exit: the interpreter's finalisation, where
gloo's threads can abort a finished process (pytorch/pytorch#179291), never runs in it."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from psarch import registry
from psarch.launch import outputs, processes, supervise
from psarch.backend import BackendSpec
from psarch.checkpoint import CheckpointError
from psarch.checkpoint.start import CHECKPOINTS, resolve_start
from psarch.cluster.device import CORE, dilation
from psarch.cluster.placement import Placement, imports_env, place
from psarch.cluster.dilation import resolve as resolve_dilation
from psarch.cluster.window import StepMarks
from psarch.config import Config, ConfigError, check_machine
from psarch.dist import abandon_group, init_rank, shutdown, under_torchrun
from psarch.errors import NON_FINITE_EXIT, NonFiniteError, RunError
from psarch.config.faults import faults
from psarch.launch.faults import Injector, Restart, Struck, at_world, check_faults, restart_world, restarts_due
from psarch.launch.lifecycle import die_with_parent, leave
from psarch.records import ServiceInfo, Summary
from psarch.launch.job import RankJob
from psarch.launch.runner import run_rank
from psarch.launch.torchrun import torchrun_rank
from psarch.throughput import warmup_steps
from psarch.launch.worlds import since, world
from psarch.trainer import Services
from psarch.workload import Workload, build_workload, shared_data


def run(cfg: Config, out: str | Path | None = None, echo: bool = True, resume: bool = False,
        start: str | Path | None = None, machine_checked: bool = False, pick: str | None = None,
        progress: bool = True) -> Summary:
    """Run one experiment and return its summary. Every rank (and service) is started here. With `resume`,
    continue the run in `out` from its latest complete checkpoint (or the one `pick` names); with `start`,
    begin from that checkpoint. echo: print the summary (and, with `progress`, the progress lines).
    machine_checked: the caller already ran check_machine(cfg) (a sweep checks every point before the first)."""
    launched = time.monotonic()
    _check(cfg, resume, start is not None, machine_checked)
    out_dir = outputs.run_folder(cfg, out)
    spec = registry.spec_of(cfg)
    cfg, begin = resolve_start(cfg, out_dir, resume, start, pick, echo, first=os.environ.get("RANK", "0") == "0",
                               move=not under_torchrun())
    # the device measured and D picked once, here, for every rank, service and link, every timeout stretched
    # by D (config.json keeps what was asked)
    ranks_cfg = resolve_dilation(cfg, echo, _threads(spec.processes(cfg)))
    job = RankJob(ranks_cfg.to_dict(), str(out_dir), echo and progress,
                  out_dir / CHECKPOINTS if cfg.train.checkpoint_every else None, begin, resume, registry.plugins())
    if under_torchrun():
        return torchrun_rank(cfg, spec, job, echo)
    # A user's factory runs here once (no process group yet), so a wrong return type is one ConfigError
    # before any rank starts; a single in-process rank then trains this very workload.
    workload = build_workload(cfg) if cfg.workload.factory else None
    outputs.prepare(out_dir, cfg, keep_checkpoints=resume)   # a fork must not keep an older run's
    struck: list[Struck] = []   # the faults injected (psarch/launch/faults.py), for the summary
    restarts: list[Restart] = []
    faulted = Summary(faults=struck, **({"restarts": restarts} if cfg.faults.restart != "none" else {})) \
        if faults(cfg) else Summary()
    if spec.processes(ranks_cfg) > 1 or spec.service_nodes(ranks_cfg):
        processes.start_server(imports_env(ranks_cfg.cluster.emulate))   # before the first world's clock starts
    t0, d = time.monotonic(), dilation(ranks_cfg)
    faulted["worlds"] = []   # each world's launch and first step (psarch/launch/worlds.py)
    faulted["dilation"] = d   # kept where a run fails too: its times (the worlds', the faults') are wall clock / d
    world_cfg, world_ranks = cfg, ranks_cfg   # the running world's (after a restart: its own, maybe at N - 1)
    try:
        while True:
            job.launched = launch = time.monotonic()   # each start-up deadline counts from here (faults.startup_s)
            world_at = since(t0, launch, d)
            try:
                extra, cluster = _world(job, spec, world_cfg, world_ranks, workload, faulted, t0)
                faulted["worlds"].append(world(out_dir / outputs.RANKS_DIR, world_at, t0, d, warmup_steps(world_cfg),
                                                 world_ranks.backend.world_size))
                break
            except RunError as e:   # faults.restart: the world starts again from a checkpoint (at N or N - 1)
                faulted["worlds"].append(world(out_dir / outputs.RANKS_DIR, world_at, t0, d, warmup_steps(world_cfg),
                                                 world_ranks.backend.world_size))
                if not restarts_due(cfg, struck, restarts):
                    raise
                world_ranks, begin = restart_world(Path(job.out), cfg, world_ranks, faulted, restarts, e, t0,
                                                   job.echo)
                world_cfg = world_ranks
                job = dataclasses.replace(job, cfg=world_ranks.to_dict(), start=begin, resume=begin is not None)
    except BaseException as e:  # failed or interrupted (Ctrl-C, SIGTERM): keep the finished steps, say why
        supervise.keep_finished_steps(out_dir, cfg, e, faulted)
        raise
    faulted["ended_at_s"] = since(t0, time.monotonic(), d)   # the run's wall time, for goodput
    extra.update(faulted)
    if cluster:
        cluster["wall_s"] = time.monotonic() - launched   # what an emulated point costs, at its D
        extra["cluster"] = cluster
    if cfg.started_from:
        extra["started_from"] = cfg.started_from
    if not outputs.has_records(out_dir):   # every worker lost: what the servers measured, and the steps streamed
        raise RunError(outputs.finalize_lost(out_dir, cfg, extra))
    return outputs.finalize(out_dir, at_world(cfg, world_cfg.backend.world_size), extra, echo)


def _check(cfg: Config, resume: bool, forks: bool, machine_checked: bool) -> None:
    """What stops a run before anything is written or started, as one ConfigError: the launcher's own rules
    (torchrun, faults, checkpoints), this machine (check_machine), and train.trainable's patterns on the model."""
    if cfg.cluster.emulate and under_torchrun():
        raise ConfigError("cluster.emulate = true: not under torchrun, whose machines are the cluster; "
                          "use `psarch run`, or --set cluster.emulate=false")
    if cfg.cluster.device == CORE and not cfg.cluster.device_tflops and under_torchrun():
        raise ConfigError(f"cluster.device = \"{CORE}\": under torchrun every rank would measure its own core and "
                          f"pace at its own rate; give the rate (cluster.device_tflops) or use \"cpu-measured\"")
    check_faults(cfg, resume)
    if not machine_checked:  # once per run: with cluster.emulate it creates and deletes a probe namespace
        check_machine(cfg)  # a missing GPU or text file: one ConfigError now, not a traceback in every rank
    if (cfg.train.trainable or cfg.train.lora_rank) and not cfg.workload.factory:
        # the patterns are checked against the model itself, built on the meta device (no memory): one line now,
        # not an error in every rank (a factory's model is built below, here too)
        build_workload(cfg, device="meta")
    if (cfg.train.checkpoint_every or resume or forks) and not registry.spec_of(cfg).checkpoints:
        raise ConfigError(f"backend.kind = {cfg.backend.kind!r} cannot write or read checkpoints yet "
                          f"(train.checkpoint_every, --resume, --from)")


def _world(job: RankJob, spec: BackendSpec, cfg: Config, ranks_cfg: Config, workload: Workload | None,
           faulted: Summary, t0: float) -> tuple[Summary, Any]:
    """Start every rank (and service) of `job`, watch them to the end; what the services measured, and the
    emulated cluster's report. `faulted`: the summary's record of the faults (psarch/launch/faults.py)."""
    out_dir = Path(job.out)
    with place(ranks_cfg) as where:   # loopback, or each process on its node of an emulated cluster
        with _services(spec, ranks_cfg, out_dir, where, job.start) as services:
            job.info = services.info.to_dict() if services is not None else {}
            if spec.processes(cfg) == 1:
                _in_process(job, spec, where, workload)
            else:
                with shared_data(cfg, out_dir / ".shared_data"):   # built here once, mapped by every rank
                    _spawn(job, spec, where, services, faulted, t0)
            extra = services.finish() if services is not None else Summary()
        return extra, where.report()


@contextlib.contextmanager
def _services(spec: BackendSpec, cfg: Config, out: Path, where: Placement, start: Path | None
              ) -> Iterator[Services | None]:
    services = spec.start_services(cfg, out, where, start)
    try:
        yield services
    finally:
        if services is not None:
            services.stop()


def _rank(job: RankJob, cfg: Config, rank: int, world: int, store: Any, marks: StepMarks | None,
          workload: Workload | None = None, process_ends: bool = True) -> None:
    """One rank of a local run: join the group (where a store is given), train, write the rank's record,
    leave the group (destroyed only where this process lives on: dist.shutdown)."""
    out = Path(job.out)
    ctx = init_rank(cfg, rank, world, rank, world, store, needs_group=store is not None)
    ctx.services = ServiceInfo.from_dict(job.info)
    outputs.save_record(out, run_rank(cfg, ctx, workload, echo=job.echo, metrics=outputs.stream_path(out, rank),
                                      marks=marks, checkpoints=job.checkpoints, start=job.start, resume=job.resume,
                                      launched=job.launched))
    # not after a failure: its barrier would wait for peers stuck in a collective
    shutdown(ctx, destroy=not process_ends)


def _in_process(job: RankJob, spec: BackendSpec, where: Placement, workload: Workload | None) -> None:
    cfg = job.config()
    store = None
    if spec.needs_process_group:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=cfg.backend.timeout_s))
    marks = where.step_marks(1)   # outside the node: the counters' reader is no node's
    try:
        with where.node("worker", 0):
            _rank(job, cfg, 0, 1, store, marks[0] if marks else None, workload, process_ends=False)
    except BaseException:
        abandon_group()   # this process lives on (a test, a sweep's next point): leave no group behind
        raise


def _rank_main(job: RankJob, rank: int, world: int, host: str, port: int, threads: int, needs_group: bool,
               marks: StepMarks | None) -> None:
    """Entry point of a spawned rank. It never returns: it leaves with os._exit once its record is written
    (0), or after writing its error (1; NON_FINITE_EXIT for a non-finite loss)."""
    die_with_parent()
    code = 0
    try:
        torch.set_num_threads(threads)
        cfg = job.config()
        store = dist.TCPStore(host, port, world, is_master=False,
                              timeout=timedelta(seconds=cfg.backend.timeout_s)) if needs_group else None
        _rank(job, cfg, rank, world, store, marks)
    except BaseException as e:  # report every failure, KeyboardInterrupt included, then exit non-zero
        supervise.write_error(Path(job.out), rank, e)
        code = NON_FINITE_EXIT if isinstance(e, NonFiniteError) else 1
    leave(code)


def _threads(world: int) -> int:
    env = os.environ.get("PSARCH_THREADS")
    return int(env) if env else max(1, (os.cpu_count() or 1) // world)


def _spawn(job: RankJob, spec: BackendSpec, where: Placement, services: Services | None,
           faulted: Summary, t0: float) -> None:
    cfg = job.config()
    n = cfg.backend.world_size
    store = None
    if spec.needs_process_group:
        with where.rendezvous():
            store = dist.TCPStore(where.rendezvous_host, 0, n + 1, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=cfg.backend.timeout_s))
    port = store.port if store is not None else 0
    ctx = where.context()
    marks = where.step_marks(n)   # an emulated cluster reads its links before the first step and after the last
    procs = [processes.process(ctx, _rank_main, (job, r, n, where.rendezvous_host, port, _threads(n),
                                                 store is not None, marks[r] if marks else None),
                               name=f"psarch-rank{r}")
             for r in range(n)]
    out = Path(job.out)

    def lost(ranks: list[int]) -> bool:
        """A worker that died is a lost one where the mode goes on without it; a poisoned one never is, nor one
        that could not write its part of a checkpoint (the checkpoint would be incomplete: the run stops)."""
        if services is None or not spec.tolerates_lost_workers(cfg) or \
                any(procs[r].exitcode == NON_FINITE_EXIT or supervise.failed_with(out, r, CheckpointError)
                    for r in ranks):
            return False
        for r in ranks:
            services.worker_lost(r, supervise.rank_error(out, r, procs[r].exitcode))
        where.worker_lost()
        return True

    injector = Injector(cfg, procs, services.pid if services is not None else lambda i: None, out,
                        faulted["faults"], t0) if faults(cfg) else None
    try:
        for r, p in enumerate(procs):
            with where.node("worker", r):
                p.start()
        supervise.watch(procs, out, lost, services.check if services is not None else lambda: None,
                        cfg.backend.timeout_s, injector.tick if injector is not None else None)
    except RunError:
        if injector is not None:   # when the launcher found the run stopped, before any teardown
            faulted["stopped_at_s"] = since(t0, time.monotonic(), dilation(cfg))
        raise
    finally:
        if injector is not None:
            injector.release()   # nothing stays stopped
        supervise.stop(procs)
