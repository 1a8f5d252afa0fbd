"""The backend-agnostic step loop of one rank: data shard, timing, logging, the rank's record."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

from psarch import checkpoint, registry
from psarch.checkpoint import finetune
from psarch.launch import progress
from psarch.launch.worlds import mark_began
from psarch import trainer as contract
from psarch.cluster import startup
from psarch.cluster.device import dilation
from psarch.cluster.call_pacing import CallDevice
from psarch.cluster.pacing import VirtualDevice
from psarch.cluster.stragglers import Straggler, pacer, slowed
from psarch.cluster.window import StepMarks
from psarch.config import Config
from psarch.config.faults import holds
from psarch.dist import DistContext
from psarch.errors import check_gradients, check_loss
from psarch.meters import local, tensor_bytes
from psarch.precision import compute_dtype
from psarch.records import RankRecord, StepRecord
from psarch.timeline import RECORDER, Span, traced_steps
from psarch.trainer import StepStats, Trainer
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


def non_finite_grads(model: torch.nn.Module) -> list[str]:
    """The parameters whose `.grad` holds inf/nan, where a backend keeps gradients on the model's parameters
    (single, ddp: views into its flat buffer); none where it keeps them elsewhere (shards, stages)."""
    return [n for n, p in model.named_parameters()
            if type(p.grad) is torch.Tensor and not bool(torch.isfinite(p.grad).all())]   # not a DTensor


class StepLoop:
    """Steps a trainer through steps [first, last) of a workload, timing each step as every figure psarch
    reports times it: the batch made and moved first, the clock around Trainer.step alone (synchronised
    on a GPU). Benchmarks drive trainers through it too, so their step times mean the same."""

    def __init__(self, trainer: Trainer, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        self.trainer, self.workload, self.ctx, self.cfg = trainer, workload, ctx, cfg
        self.cast = None if cfg.train.precision == "fp32" else compute_dtype(cfg.train.precision)
        self.sync = ctx.device.type == "cuda"
        self.shard = registry.spec_of(cfg).batch_shard(cfg, ctx.rank, ctx.world_size)

    def batch(self, step: int) -> Any:
        return to_device(self.workload.batch(step, *self.shard), self.ctx.device, self.cast)

    def timed(self, step: int) -> float:
        """Take step `step` (its batch made first, outside the clock); its seconds."""
        return self.step(self.batch(step))[1]

    def step(self, batch: Any) -> tuple[StepStats, float]:
        """One step; (its stats, its seconds)."""
        if self.sync:
            torch.cuda.synchronize(self.ctx.device)
        t0 = time.perf_counter()
        stats = self.trainer.step(batch)
        if self.sync:
            torch.cuda.synchronize(self.ctx.device)
        return stats, time.perf_counter() - t0


def run_rank(cfg: Config, ctx: DistContext, workload: Workload | None = None, echo: bool = True,
             checkpoints: Path | None = None, start: Path | None = None, resume: bool = False,
             metrics: Path | None = None, marks: StepMarks | None = None, launched: float | None = None) -> RankRecord:
    """Train up to step `train.steps` on this rank, from step 0 or from checkpoint `start`'s step and state
    (with `resume`, also its step records; a base model's checkpoint under a LoRA or frozen config: its weights
    only, from step 0, psarch.checkpoint.finetune), writing a checkpoint under `checkpoints` every
    `train.checkpoint_every` steps; returns the rank's record (step records, memory, traffic, model). With
    `metrics`, the carried records and then each step's record as the step completes are also appended
    there, so a run that fails or is interrupted keeps every finished step. `marks` (an emulated cluster's):
    reached right before the first step and right after the last, where the launcher reads the links' counters.
    `launched`: when the launcher launched this world (time.monotonic()), the origin of its start-up's deadline
    (faults.startup_s, psarch.cluster.startup)."""
    workload = workload or build_workload(cfg)
    slow = pacer(cfg, ctx.rank, workload)   # a virtual device, slow_workers, jitter: the backend never knows
    workload = slowed(workload, slow)
    # before a backend shards the model: Φ, the parameters that train, and those frozen
    params = sum(p.numel() for p in workload.model.parameters() if p.requires_grad)
    # the model's, before a backend drops or splits what its rank does not keep (no reference kept: that would
    # hold the whole frozen weights alive beside a backend's parts of them)
    frozen_names = {n for n, p in workload.model.named_parameters() if not p.requires_grad}
    frozen_count = sum(p.numel() for n, p in workload.model.named_parameters() if n in frozen_names)
    ckpt, base = _open_start(cfg, workload, start, resume)
    spec = registry.spec_of(cfg)
    trainer = contract.load_trainer(cfg.backend.kind)(workload, cfg, ctx)
    if slow is not None:   # its compute is the forward and backward less the waits the backend timed in them
        slow.waited = trainer.comm_waited_s
    if isinstance(slow, VirtualDevice):   # a compression's own work, at the device's rates where it is done
        trainer.pace_work(slow.work)
    first, records = _restore(trainer, ctx, ckpt, base, resume)   # records: this rank's step records
    stream = open(metrics, "a", buffering=1) if metrics is not None else None  # line-buffered: a record per write
    board = None
    try:
        if stream is not None:   # the carried records first: a resumed run that then fails still keeps them
            stream.write("".join(json.dumps(r) + "\n" for r in records))
        if echo and ctx.rank == 0 and ckpt is not None:
            print(f"psarch: {'resumed' if resume else 'started'} from {start} at step {first}", flush=True)
        board = progress.board(cfg, ctx, metrics, fresh=first == 0 or not resume)
        log = progress.Progress(cfg, ctx, workload.entropy_floor, echo, lockstep=spec.lockstep(cfg), board=board,
                                losses=progress.rank_losses(cfg, ctx, spec.needs_process_group, metrics,
                                                            echo or board is not None))
        save = _checkpointer(trainer, cfg, ctx, checkpoints)
        timeline: list[Span] = []
        _steps(StepLoop(trainer, workload, cfg, ctx), range(first, cfg.train.steps), records, stream, slow, marks,
               log, save, timeline, metrics, startup.deadline(cfg, launched))
        state = trainer.full_state_dict()   # a collective call: before the figures, which then include it
        memory = trainer.memory()
        # frozen weights are the model's own tensors as the backend left them (a DTensor's local shard, a tensor
        # rank's part, a pipeline stage's own; a backend holding more copies, dp's replicas, reports them itself)
        memory.frozen = memory.frozen or tensor_bytes(local(p) for n, p in workload.model.named_parameters()
                                                      if n in frozen_names)
        record = RankRecord(ctx.rank, records, memory.to_dict(), trainer.traffic().to_dict(),
                            trainer.summary_extra(), str(ctx.device), ctx.dist_backend, workload.entropy_floor,
                            params, workload.name, state if ctx.rank == 0 else None,
                            virtual_device=slow.facts() if isinstance(slow, (VirtualDevice, CallDevice)) else None,
                            frozen_params=frozen_count,
                            timeline=[x.to_dict() for x in timeline])
    finally:
        if stream is not None:
            stream.close()
        if board is not None:
            board.close()
        trainer.close()
        if slow is not None:
            slow.close()
    return record


def _open_start(cfg: Config, workload: Workload, start: Path | None, resume: bool
                ) -> tuple[checkpoint.Checkpoint | None, bool]:
    """The checkpoint this rank starts from (None: step 0), and whether it is a base model's under a LoRA or frozen
    config (its weights loaded into the model here); any other is checked against the model. Both before a
    backend copies the model."""
    ckpt = checkpoint.Checkpoint(start) if start is not None else None
    try:
        base = ckpt is not None and not resume and finetune.is_base_start(cfg, ckpt, workload.model)
    except checkpoint.CheckpointError:   # refused: the checkpoint is closed before the error goes on
        assert ckpt is not None
        ckpt.close()
        raise
    if ckpt is not None and base:   # fine-tuning a base model's checkpoint: its weights, before the backend copies them
        finetune.load_base(workload.model, ckpt)
    elif ckpt is not None:  # the launcher verified sizes and checksums; check the model before building
        ckpt.check_model({n: tuple(p.shape) for n, p in workload.model.named_parameters() if p.requires_grad})
        ckpt.check_optimizer(cfg.train.optimizer)
        if resume:
            finetune.restore_base(cfg, workload.model)
    return ckpt, base


def _restore(trainer: Trainer, ctx: DistContext, ckpt: checkpoint.Checkpoint | None, base: bool, resume: bool
             ) -> tuple[int, list[StepRecord]]:
    """The trainer's state from the starting checkpoint, which is then closed: the first step and the step records
    carried on (with `resume`); step 0 and none without a checkpoint or from a base model's."""
    first, records = 0, []
    if ckpt is not None and base:   # a new run from step 0: its optimizer, generators and data start fresh
        ckpt.close()
    elif ckpt is not None:
        trainer.load_checkpoint(ckpt)
        ckpt.restore_rng(ctx.rank, ctx.device)   # dropout goes on drawing where it stopped
        records = ckpt.steps(ctx.rank) if resume else []
        first = ckpt.step  # data is a function of (seed, step): continuing the step continues the data
        ckpt.close()
    return first, records


def _steps(loop: StepLoop, steps: range, records: list[StepRecord], stream: TextIO | None,
           slow: Straggler | VirtualDevice | CallDevice | None, marks: StepMarks | None, log: progress.Progress,
           save: Callable[[int, list[StepRecord]], None], timeline: list[Span] | None = None,
           metrics: Path | None = None, start_by: float | None = None) -> None:
    """The step loop: each step's record appended (and streamed) before its loss and its update are checked,
    so the metrics keep a bad step; progress lines and checkpoints between steps. Times are the cluster's: the
    wall clock / cluster.dilation (1 but on an emulated cluster of virtual devices). The steps train.trace_steps
    names are recorded into `timeline` (psarch.timeline). With `metrics` (the stream's path), the moment the first
    step begins is marked beside it (psarch.launch.worlds: a world's start-up). With `start_by` (time.monotonic(),
    faults.startup_s), the first step waits for it: the world's start-up paced as the cluster's."""
    trainer, rank, d = loop.trainer, loop.ctx.rank, dilation(loop.cfg)
    traced = traced_steps(loop.cfg.train.steps, loop.cfg.train.trace_steps)
    last = trainer.traffic()  # set-up traffic (e.g. the initial broadcast) is not any step's
    if marks is not None:
        marks.reached()
    late = startup.hold(start_by)   # after every rank is here (marks): the world's first step at its deadline
    if metrics is not None and len(steps):
        mark_began(metrics, steps[0], late)
    hold = set(holds(loop.cfg, rank))
    step = steps.start
    while step < steps.stop:
        if any(h <= step for h in hold):   # a [faults] entry strikes here, or at the step after those a
            hold = {h for h in hold if h > step}   # re-admitted PS worker skipped: the launcher takes it on
            os.kill(os.getpid(), signal.SIGSTOP)
        batch = loop.batch(step)
        if slow is not None:
            slow.step = step
        RECORDER.on = step in traced and timeline is not None
        t0 = time.perf_counter()
        stats, dt = loop.step(batch)
        if RECORDER.on and timeline is not None:
            RECORDER.add("step", f"step {step}", t0, time.perf_counter())
            RECORDER.on = False
            # the cluster's time: epoch seconds / D, so every rank's spans keep one origin (the trace's earliest)
            timeline.extend(Span(x.node, x.lane, x.name, x.start / d, x.end / d)
                            for x in RECORDER.take(f"rank {rank}"))
        tr = trainer.traffic()
        record = StepRecord(step=step, rank=rank, loss=stats.loss, step_time_s=dt / d, comm_s=stats.comm_s / d,
                            sent=tr.sent - last.sent, received=tr.received - last.received, skipped=stats.skipped,
                            loss_scale=stats.loss_scale, extra=stats.extra)
        if slow is not None:
            record.update(slow.fields())
        records.append(record)
        last = tr
        if stream is not None:
            stream.write(json.dumps(records[-1]) + "\n")
        scaling = loop.cfg.train.precision == "fp16"   # only fp16's loss scaling skips steps by design
        check_loss(step, rank, stats.loss, stats.skipped and scaling)
        check_gradients(step, rank, stats.loss, stats.skipped and not scaling,
                        lambda: non_finite_grads(loop.workload.model))
        log.after(step, records, stats)
        step = trainer.next_step(step)   # a re-admitted ps worker skips the rounds that went on without it
        save(step, records)
    if marks is not None:
        marks.reached()


def _checkpointer(trainer: Trainer, cfg: Config, ctx: DistContext, root: Path | None
                  ) -> Callable[[int, list[StepRecord]], None]:
    """Writes a checkpoint after every train.checkpoint_every-th step (never without a checkpoint folder)."""
    every = cfg.train.checkpoint_every

    def save(done: int, records: list[StepRecord]) -> None:
        if root is not None and every and done % every == 0:
            trainer.write_checkpoint(ctx, root, done, cfg.to_dict(), cfg.train.keep_checkpoints, records)
    return save
