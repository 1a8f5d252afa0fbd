"""cluster.device = "cpu-core": this machine's core measured alone, the device an emulated cluster's workers
stand for by default. The run's own model, a worker's batch, forward and backward on one thread in this one
process (the launcher, before any rank starts), its FLOPs counted as the pacing counts them
(psarch.cluster.flops): FLOPs / seconds is the rate every worker is then paced at. The model is timed in the
run's compute dtype (`train.precision`), as its trainers cast it: a CPU's bf16 is not its fp32."""
from __future__ import annotations

import dataclasses

import time
from typing import TYPE_CHECKING

import torch

from psarch.cluster.flops import count
from psarch.precision import compute_dtype

if TYPE_CHECKING:
    from psarch.config import Config
    from psarch.workload import Workload

WARMUP, TIMED = 2, 5   # untimed passes (allocator, first-call costs), then timed ones


def probe_workload(cfg: Config) -> "Workload":
    """The run's workload with its embedding tables held, whatever the backend: a worker without them (PS rows,
    ddp sharded, the hybrid) reads its rows from a compact table, as many FLOPs, and a model whose tables are
    on the meta device cannot run a probe."""
    from psarch.workload import build_workload
    return build_workload(dataclasses.replace(cfg, backend=dataclasses.replace(cfg.backend, embeddings="dense")))


def flops_per_s(cfg: Config) -> float:
    """FLOP/s of one worker's forward and backward on one thread: the fastest of TIMED passes after WARMUP,
    the fastest being the one least touched by whatever else this machine runs meanwhile."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):   # the launcher's random state stays as it was
            workload = probe_workload(cfg)
            model = workload.model.to(compute_dtype(cfg.train.precision))
            batch = workload.batch(0, 0, cfg.backend.world_size)
            flops = count(model, workload.loss_fn, batch)
            times = []
            for i in range(WARMUP + TIMED):
                t0 = time.perf_counter()
                workload.loss_fn(model, batch).backward()
                if i >= WARMUP:
                    times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return (flops.forward + flops.backward) / min(times)
