"""Pipeline parallelism, with data parallelism beside it: world_size = dp x p ranks, rank = dp_rank x p + stage.

Each rank builds the whole model (the same seed everywhere), cuts it (stage.Cut) and keeps the units of its
stage (its v chunks, interleaved); its parameters and gradients are views into one flat buffer, as in DDP.
A step splits the pipeline's shard of the global batch (every stage of a pipeline reads the same one) into
m micro-batches and runs the rank's instruction list (engine.Engine); then the stage's gradients are
all-reduced over its data-parallel group (one ring or native all-reduce over dp ranks, pre-divided by dp) and
the optimizer steps the stage's own parameters. The last stage's loss (the mean over the micro-batches,
then over the dp pipelines) goes to every other stage, so every rank reports the loss `single` reports.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from collective.communicators import make_communicator
from collective.pipeline.engine import Engine
from collective.pipeline.export import gather_masters, layout_of
from collective.pipeline.p2p import P2P, tag
from collective.pipeline.schedule import Pipe, instructions
from collective.pipeline.stage import Cut
from collective.pipeline.theory import pipe_of
from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import Pieces, master_fragments, restore_optimizer, scaler_state, share_of
from psarch.config import Config
from psarch.dist import DistContext
from psarch.flat import FlatParams
from psarch.meters import TrafficMeter, flat_memory
from psarch.precision import MixedPrecisionOptimizer, compute_dtype
from psarch.launch.runner import to_device
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.workload import Workload


def micro_batches(batch: Any, m: int) -> list[Any]:
    """The batch cut along its first dimension into m equal micro-batches, each its own copy (so what a stage
    keeps of one for backward is that micro-batch, not the whole batch it was cut from)."""
    if torch.is_tensor(batch):
        if batch.shape[0] % m:
            raise ValueError(f"a batch of {batch.shape[0]} rows does not split into backend.microbatches = {m}")
        return [c.clone() for c in batch.chunk(m)]
    if isinstance(batch, (list, tuple)):
        parts = [micro_batches(b, m) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(m)]
    if isinstance(batch, dict):
        by_key = {k: micro_batches(v, m) for k, v in batch.items()}
        return [{k: v[i] for k, v in by_key.items()} for i in range(m)]
    return [batch] * m


class PipelineTrainer(Trainer):
    """One stage of one pipeline; its data-parallel replicas hold the same stage in the other pipelines."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        b = cfg.backend
        self.ctx, self.cfg = ctx, cfg
        self.pipe: Pipe = pipe_of(cfg)
        self.dp = ctx.world_size // self.pipe.p
        self.stage, self.dp_rank = ctx.rank % self.pipe.p, ctx.rank // self.pipe.p
        self.model = workload.model.to(ctx.device, compute_dtype(cfg.train.precision))
        cast = None if cfg.train.precision == "fp32" else compute_dtype(cfg.train.precision)
        local = to_device(workload.batch(0, self.dp_rank, self.dp), ctx.device, cast)
        sample = micro_batches(local, self.pipe.m)[0]   # what the trace of the forward runs on
        self.chunks_of = [[self.pipe.stage_of(r, c) for c in range(self.pipe.v)] for r in range(self.pipe.p)]
        self.cut = Cut(self.model, b.zero_units, workload.loss_fn, sample, self.pipe.virtual,
                       self.chunks_of[self.stage])
        self.flat = FlatParams(self.cut.params)
        self.optim = MixedPrecisionOptimizer([self.flat.data], cfg.train, cfg.train.precision)
        self.comm = self._dp_communicator(b.comm)
        self.meter = TrafficMeter()
        self.p2p = P2P(ctx.group, self.meter)
        self.engine = Engine(self.cut, self.p2p, self.pipe, self.stage, self._global(0),
                             instructions(b.schedule, self.pipe, self.stage), workload.loss_fn,
                             self.optim.scaler.scale_loss,
                             lambda: {self.flat.data.untyped_storage().data_ptr()})
        self._layout = self._layout_of(self.stage)
        self._measured = False
        self.activations_peak: int | None = None
        self.idle: list[float] = []
        self._loss_sends: list = []

    def _dp_communicator(self, kind: str):
        """The communicator over this stage's data-parallel group (None for one pipeline). Every rank creates
        every stage's group, in stage order, as torch.distributed requires."""
        if self.dp == 1:
            return None
        mine = None
        for s in range(self.pipe.p):
            group = dist.new_group([d * self.pipe.p + s for d in range(self.dp)])
            mine = group if s == self.stage else mine
        return make_communicator(kind, mine)

    def _global(self, stage: int) -> int:
        """The global rank of stage `stage` of this rank's pipeline."""
        return self.dp_rank * self.pipe.p + stage

    def _layout_of(self, stage: int, shapes: dict[str, tuple[int, ...]] | None = None) -> list[tuple[str, torch.Size, int]]:
        """(name, shape, flat offset) of the parameters stage `stage` holds, in the model's order (of `shapes`:
        by default those that train)."""
        chunks, shapes = self.chunks_of[stage], self.cut.shapes if shapes is None else shapes
        return layout_of(shapes, {n for n in shapes if self.cut.owners[id(self.model.get_parameter(n))] in chunks})

    def _export_layout(self, stage: int) -> list[tuple[str, torch.Size, int]]:
        """What stage `stage` sends to rank 0 for the consolidated model: its trained parameters, then its
        frozen ones (each only on its own stage)."""
        trained = self._layout_of(stage)
        end = sum(shape.numel() for _, shape, _ in trained)
        return trained + [(n, s, o + end) for n, s, o in self._layout_of(stage, self.cut.frozen_shapes)]

    def step(self, batch: Any) -> StepStats:
        self.flat.zero_grad()
        measure = not self._measured   # activations are the same every step: counted once, off the timed steps
        out = self.engine.run(micro_batches(batch, self.pipe.m), measure)
        if measure:
            self.activations_peak, self._measured = out.activations_peak, True
        t0 = time.perf_counter()
        if self.comm is not None:
            self.flat.grad.div_(self.dp)
            self.comm.all_reduce(self.flat.grad)
        loss = self._share_loss(out.losses)
        comm_s = out.waited_s + time.perf_counter() - t0
        skipped = self.optim.step([self.flat.grad])
        self.idle.append(out.idle_fraction)
        return StepStats(loss, skipped=skipped, loss_scale=self.optim.scaler.scale, comm_s=comm_s,
                         extra={"idle_fraction": out.idle_fraction, "pipeline_s": out.phase_s})

    def _share_loss(self, losses: list[torch.Tensor]) -> float:
        """The mean loss over the global batch, on every rank: the last stage averages its micro-batches,
        all-reduces over dp, and sends the result to the other stages of its pipeline."""
        last, device = self.pipe.p - 1, self.cut.device
        if self.stage == last:
            value = torch.stack([x.double() for x in losses]).mean().reshape(1).to(device)
            if self.comm is not None:
                self.comm.all_reduce(value)
                value /= self.dp
            # waited on at the next step's loss (or close): a send completes only once its receiver takes it,
            # after its own pipeline phase, and this rank's wait for that belongs to the next phase's bubble
            self._wait_loss_sends()
            self._loss_sends = [self.p2p.send(value, self._global(s), "loss", tag("loss", 0, 0, self.pipe.m))
                                for s in range(last)]
            return float(value.item())
        got = self.p2p.recv((1,), torch.float64, device, self._global(last), "loss", tag("loss", 0, 0, self.pipe.m))
        return float(got.wait().item())

    def _wait_loss_sends(self) -> None:
        for s in self._loss_sends:
            s.wait()
        self._loss_sends = []

    # ---------------------------------------------------------------- the model's state

    def _master(self) -> torch.Tensor:
        """This stage's fp32 master parameters, flat (the model's own buffer in fp32)."""
        return self.optim.master.params[0].detach().view(-1)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Pipeline 0's stages send their fp32 masters to rank 0 (booked as export traffic)."""
        layouts = [self._export_layout(s) for s in range(self.pipe.p)]
        frozen = [self.model.get_parameter(n).detach().reshape(-1).float()
                  for n, _, _ in self._layout_of(self.stage, self.cut.frozen_shapes)]
        with self.meter.tagged("export"):
            values = gather_masters(self.p2p, torch.cat([self._master(), *frozen]), self.stage, self.dp_rank,
                                    layouts)
        if values is None:
            return {}
        # buffers are every rank's own; parameters as gathered
        return {name: values[name] if name in values else value.detach().to("cpu", copy=True)
                for name, value in self.model.state_dict().items()}

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """The stage's parameters; its dp replicas each write a share of them."""
        frags = master_fragments(self.optim, 0, self._layout, 0, self.flat.numel)
        return Pieces(share_of(frags, self.dp_rank, self.dp) if writing else frags, dict(self.cut.shapes),
                      scaler_state(self.optim.scaler))

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        restore_optimizer(self.optim, ckpt, lambda: master_fragments(self.optim, 0, self._layout, 0, self.flat.numel))

    # ---------------------------------------------------------------- reports

    def memory(self) -> MemoryReport:
        return flat_memory(self.ctx.device, self.flat, self.optim.state_bytes())

    def traffic(self) -> TrafficReport:
        ops = dict(self.meter.report().ops)
        modelled = False
        if self.comm is not None:
            ops.update(self.comm.traffic.report().ops)
            modelled = self.comm.traffic.modelled
        return TrafficReport(ops, modelled=modelled)

    def summary_extra(self) -> dict[str, Any]:
        idle = sorted(self.idle[1:] or self.idle)
        return {"pipeline_stage": self.stage, "pipeline_dp_rank": self.dp_rank,
                "activations_held": self.activations_peak,
                "idle_fraction": idle[len(idle) // 2] if idle else None}

    def comm_waited_s(self) -> float:
        return self.engine.waited_total

    def close(self) -> None:
        self._wait_loss_sends()
        if self.comm is not None:
            self.comm.close()
