"""One rank of a torchrun job (`psarch run` under torchrun): rank 0 starts the services and writes the run folder's
summary, every rank trains (psarch.launch.runner) and hands its record to rank 0 as JSON over the process group."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Mapping, cast

import torch
import torch.distributed as dist

from psarch.backend import BackendSpec
from psarch.config import Config
from psarch.dist import init_rank, shutdown
from psarch.errors import RunError
from psarch.launch import outputs, supervise
from psarch.launch.job import RankJob
from psarch.launch.lifecycle import leave
from psarch.launch.runner import run_rank
from psarch.records import RankRecord, ServiceFields, ServiceInfo, Summary


def torchrun_rank(cfg: Config, spec: BackendSpec, job: RankJob, echo: bool) -> Summary:
    """One rank of a torchrun job. Services (the parameter servers of `ps` without
    backend.server_addresses) are started by rank 0, which is also worker 0, as `psarch run` starts
    them; their addresses reach every rank as JSON over the process group (no pickle) before any
    trainer is built. A rank that fails prints its error and exits at once: a barrier here would
    only wait for peers stuck in a collective and replace the error with its own timeout."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != spec.processes(cfg):
        if spec.processes(cfg) == 1:
            raise RunError(f"backend.kind = {cfg.backend.kind!r} runs in one process (its workers are threads): "
                           f"use `psarch run`, not torchrun")
        raise RunError(f"backend.world_size = {cfg.backend.world_size}: torchrun started WORLD_SIZE = {world} ranks")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    out = Path(job.out)
    services = None
    try:
        if rank == 0:
            outputs.prepare(out, cfg, keep_checkpoints=job.resume)
        ctx = init_rank(cfg, rank, world, local_rank, local_world, None, launched_by="torchrun", needs_group=True)
        # every rank takes part in the gather: only rank 0 knows whether the backend started services
        if rank == 0:
            services = spec.start_services(cfg, out, start=job.start)
            if services is not None:
                info = services.info.to_dict()
                info["addresses"] = [_reachable(a) for a in services.info.addresses]
                job.info = info
        ctx.services = ServiceInfo.from_dict(cast(ServiceFields, _gather_json(ctx, job.info)[0]))   # rank 0's
        # ranks on other machines stream only where the run folder is shared (rank 0 made it before init_rank)
        stream = outputs.stream_path(out, rank) if (out / outputs.RANKS_DIR).is_dir() else None
        record = run_rank(cfg, ctx, echo=job.echo, metrics=stream, checkpoints=job.checkpoints, start=job.start,
                          resume=job.resume)
        records = _gather_json(ctx, record.to_json())   # every rank is done with the servers past this point
        extra: Summary | None = None
        if rank == 0:
            outputs.save_record(out, record)
            for r in records[1:]:
                outputs.save_record(out, RankRecord.from_json(r))
            if services is not None:
                extra = services.finish()   # the servers' measurements; model.pt from their parameters
                services.stop()
                services = None
    except BaseException as e:  # say why, then leave without the teardown barrier (torchrun stops the peers)
        if rank == 0 and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)   # torchrun's stop for the peers must not cut this short
        print(f"rank {rank} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if rank == 0 and (out / outputs.RANKS_DIR).is_dir():   # the steps streamed so far, as `psarch run` keeps them
            supervise.keep_finished_steps(out, cfg, e)
        if services is not None:
            services.stop()
        leave(1)
    shutdown(ctx)   # destroyed: this process may run another (a sweep's next point, the Python API)
    if rank == 0 and cfg.started_from:
        extra = extra if extra is not None else Summary()
        extra["started_from"] = cfg.started_from
    return outputs.finalize(out, cfg, extra, echo) if rank == 0 else {}


def _reachable(address: str) -> str:
    """A server bound to every interface (backend.host = 0.0.0.0) is reached at rank 0's host, which
    torchrun names in MASTER_ADDR."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    return f"{scheme}://{os.environ['MASTER_ADDR']}:{port}" if host in ("0.0.0.0", "*") else address


def _gather_json(ctx: Any, obj: Mapping[str, object]) -> list[dict]:
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
