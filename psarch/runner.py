"""The backend-agnostic step loop of one rank: data shard, timing, logging, the rank's record."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from psarch import checkpoint
from psarch.cluster.stragglers import slowed, straggler
from psarch.cluster.window import StepMarks
from psarch.config import Config
from psarch.dist import DistContext
from psarch.errors import check_loss
from psarch.precision import compute_dtype
from psarch.registry import trainer_class
from psarch.units import fmt_bytes
from psarch.workload import Workload, build_workload


def to_device(batch: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """The batch on `device`; with `dtype`, its floating-point tensors cast to it (the model's compute dtype
    in bf16/fp16, as DeepSpeed casts inputs and FSDP's MixedPrecision(cast_forward_inputs=True) does), so a
    user's loss_fn need not. Integer tensors (tokens, labels) are never cast."""
    if torch.is_tensor(batch):
        if dtype is not None and batch.is_floating_point():
            return batch.to(device, dtype, non_blocking=True)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, dtype) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, dtype) for k, v in batch.items()}
    return batch


def warmup_steps(cfg: Config) -> int:
    w = cfg.train.warmup_steps
    return min(5, cfg.train.steps // 5) if w < 0 else min(w, cfg.train.steps - 1)


def run_rank(cfg: Config, ctx: DistContext, workload: Workload | None = None, echo: bool = True,
             checkpoints: Path | None = None, start: Path | None = None, resume: bool = False,
             metrics: Path | None = None, marks: StepMarks | None = None) -> dict[str, Any]:
    """Train up to step `train.steps` on this rank, from step 0 or from checkpoint `start`'s step and state
    (with `resume`, also its metric rows), writing a checkpoint under `checkpoints` every
    `train.checkpoint_every` steps; returns the rank's record (rows, memory, traffic, model). With
    `metrics`, the carried rows and then each step's row as the step completes are also appended there, so a
    run that fails or is interrupted keeps every finished step. `marks` (an emulated cluster's): reached right
    before the first step and right after the last, where the launcher reads the links' counters."""
    slow = straggler(cfg, ctx.rank)   # cluster.slow_workers / jitter: the backend never knows
    workload = slowed(workload or build_workload(cfg), slow)
    params = sum(p.numel() for p in workload.model.parameters())  # before a backend shards the model
    ckpt = None
    if start is not None:  # the launcher verified sizes and checksums; check the model before building
        ckpt = checkpoint.Checkpoint(start)
        ckpt.check_model({n: tuple(p.shape) for n, p in workload.model.named_parameters() if p.requires_grad})
        ckpt.check_optimizer(cfg.train.optimizer)
    trainer = trainer_class(cfg.backend.kind)(workload, cfg, ctx)
    if slow is not None:   # its compute is the forward and backward less the waits the backend timed in them
        slow.waited = trainer.comm_waited_s
    first = 0
    if ckpt is not None:
        trainer.load_checkpoint(ckpt)
        ckpt.restore_rng(ctx.rank, ctx.device)   # dropout goes on drawing where it stopped
        ckpt.close()
        first = ckpt.step  # data is a function of (seed, step): continuing the step continues the data
    every = cfg.train.checkpoint_every if checkpoints is not None else 0
    cast = None if cfg.train.precision == "fp32" else compute_dtype(cfg.train.precision)  # fp32: batches as given
    sync = ctx.device.type == "cuda"
    rows: list[dict[str, Any]] = ckpt.rows(ctx.rank) if ckpt is not None and resume else []
    log_every, steps = cfg.train.log_every, cfg.train.steps
    tr0 = trainer.traffic()  # set-up traffic (e.g. the initial broadcast) is not any step's
    last_sent, last_recv = tr0.sent, tr0.received
    interval_t0 = time.perf_counter()
    stream = open(metrics, "a", buffering=1) if metrics is not None else None  # line-buffered: a row per write
    if stream is not None:   # the carried rows first: a resumed run that then fails still keeps them
        stream.write("".join(json.dumps(r) + "\n" for r in rows))
    try:
        if marks is not None:
            marks.reached()
            interval_t0 = time.perf_counter()
        for step in range(first, steps):
            batch = to_device(workload.batch(step, ctx.rank, ctx.world_size), ctx.device, cast)
            if slow is not None:
                slow.step = step
            if sync:
                torch.cuda.synchronize(ctx.device)
            t0 = time.perf_counter()
            stats = trainer.step(batch)
            if sync:
                torch.cuda.synchronize(ctx.device)
            dt = time.perf_counter() - t0
            tr = trainer.traffic()
            rows.append({"step": step, "rank": ctx.rank, "loss": stats.loss, "step_time_s": dt,
                         "comm_s": stats.comm_s, "sent": tr.sent - last_sent, "received": tr.received - last_recv,
                         "skipped": stats.skipped, "loss_scale": stats.loss_scale, "extra": stats.extra,
                         **({"slept_s": slow.slept_s} if slow is not None else {})})
            last_sent, last_recv = tr.sent, tr.received
            if stream is not None:
                stream.write(json.dumps(rows[-1]) + "\n")
            check_loss(step, ctx.rank, stats.loss, stats.skipped)   # after its row: the metrics keep the bad step
            if (step + 1) % log_every == 0 or step + 1 == steps:
                interval = rows[-((step % log_every) + 1):]
                loss = statistics.fmean(r["loss"] for r in interval)
                if trainer.synchronous:
                    loss = ctx.mean_across_ranks(loss)
                if echo and ctx.rank == 0:
                    elapsed = time.perf_counter() - interval_t0
                    _progress(step, steps, len(interval), loss, workload.entropy_floor, len(interval) * cfg.train.global_batch / elapsed,
                              statistics.fmean(r["sent"] for r in interval), sum(r["skipped"] for r in interval),
                              stats)
                interval_t0 = time.perf_counter()
            if every and (step + 1) % every == 0:
                trainer.write_checkpoint(ctx, checkpoints, step + 1, cfg.to_dict(), cfg.train.keep_checkpoints, rows)
        if marks is not None:
            marks.reached()
        model_state = trainer.full_state_dict()
        memory = trainer.memory().to_dict()
        traffic = trainer.traffic().to_dict()
        extra = trainer.summary_extra()
    finally:
        if stream is not None:
            stream.close()
        trainer.close()
    return {"rank": ctx.rank, "rows": rows, "memory": memory, "traffic": traffic, "extra": extra,
            "device": str(ctx.device), "dist_backend": ctx.dist_backend,
            "entropy_floor": workload.entropy_floor, "params": params,
            "workload": workload.name, "model_state": model_state if ctx.rank == 0 else None}


def _progress(step: int, steps: int, window: int, loss: float, floor: float | None, samples_per_s: float,
              bytes_per_step: float, skipped: int, stats: Any) -> None:
    """One progress line: the loss is the mean over the `window` steps since the last line (and across
    ranks for synchronous backends), unlike the summary's final loss, which is the last step's."""
    gap = f"  gap {loss - floor:7.4f}" if floor is not None else ""
    # fp16 steps dropped for inf/nan gradients: the loss above moved without an update
    skip = f"  skipped {skipped}" if skipped else ""
    scale = f"  scale {stats.loss_scale:g}" if stats.loss_scale not in (None, 1.0) else ""
    print(f"step {step + 1:>6}/{steps}  {window}-step mean loss {loss:8.4f}{gap}  {samples_per_s:9.1f} samples/s  "
          f"{fmt_bytes(bytes_per_step)}/step sent{skip}{scale}", flush=True)

