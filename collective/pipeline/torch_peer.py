"""The peer of `pipeline`: torch.distributed.pipelining's own schedules (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B) on PipelineStage modules, run by the same runner on the same data.

PipelineStage wants each stage as a module of its own, so psarch's GPT is cut by hand here as torchtitan cuts
its models (the first stage keeps the embeddings, the last the final norm and head; the loss is the
schedule's): the same blocks per stage as `pipeline` (stage.split_blocks). With dp > 1 each stage's gradients
are all-reduced over its dp group with torch.distributed.all_reduce. torch's point-to-point is not seen by
psarch, so its traffic is theory's volume for the rank, marked modelled.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from collective.pipeline import theory
from collective.pipeline.export import gather_masters, layout_of
from collective.pipeline.p2p import P2P
from collective.pipeline.stage import split_blocks
from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import Pieces, master_fragments, restore_optimizer, scaler_state, share_of
from psarch.config import Config
from psarch.dist import DistContext
from psarch.flat import FlatParams
from psarch.meters import TrafficMeter, flat_memory
from psarch.models.gpt import GPT
from psarch.precision import MixedPrecisionOptimizer
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.workload import Workload

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class GPTStage(nn.Module):
    """Blocks `blocks` of psarch's GPT, with its embeddings on the first stage and its head on the last."""

    def __init__(self, gpt: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed, self.pos = gpt.embed, gpt.pos
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in blocks)
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """psarch.workload.next_token_loss, split as torch's schedules take it: (output, target)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


class TorchPipelineTrainer(Trainer):
    """One stage (its v chunks) of one pipeline under torch.distributed.pipelining."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        self.ctx, self.cfg = ctx, cfg
        self.pipe = theory.pipe_of(cfg)
        p, v = self.pipe.p, self.pipe.v
        self.dp = ctx.world_size // p
        self.stage, self.dp_rank = ctx.rank % p, ctx.rank // p
        gpt = workload.model.to(ctx.device)
        assert isinstance(gpt, GPT)   # TorchPipelineSpec.check: workload.model = "gpt", no factory
        names = {id(x): n for n, x in gpt.named_parameters()}
        self.names = list(names.values())
        # what trains (train.trainable, LoRA) is in the flat buffer; the frozen weights each stage keeps apart
        self.shapes = {n: tuple(x.shape) for n, x in gpt.named_parameters() if x.requires_grad}
        self.frozen_shapes = {n: tuple(x.shape) for n, x in gpt.named_parameters() if not x.requires_grad}
        self.pp_group, self.dp_group = self._groups()
        self.ranges = ranges = split_blocks(len(gpt.blocks), self.pipe.virtual)
        self.modules, stages = [], []
        for c in range(v):
            j = self.pipe.stage_of(self.stage, c)
            mod = GPTStage(gpt, ranges[j], j == 0, j == self.pipe.virtual - 1)
            self.modules.append(mod)
            stages.append(PipelineStage(mod, j, self.pipe.virtual, ctx.device, group=self.pp_group))
        params = [x for mod in self.modules for x in mod.parameters() if x.requires_grad]
        self.frozen = [x for mod in self.modules for x in mod.parameters() if not x.requires_grad]
        held = {id(x) for mod in self.modules for x in mod.parameters()}
        with torch.no_grad():   # the other stages' weights: not kept here (frozen ones included)
            for x in gpt.parameters():
                if id(x) not in held:
                    x.data = torch.empty(0, dtype=x.dtype, device=x.device)
        self.flat = FlatParams(params)
        self.layout = [(names[id(x)], x.shape, o) for x, o in zip(self.flat.params, self.flat.offsets)]
        if self.layout != self._layout_of(self.stage):   # the stage modules keep the model's order
            raise RuntimeError("torch_pipeline: the stage modules lay out their parameters otherwise than the model")
        self.optim = MixedPrecisionOptimizer([self.flat.data], cfg.train, cfg.train.precision)
        kind = SCHEDULES[cfg.backend.schedule]
        self.schedule = kind(stages if kind is ScheduleInterleaved1F1B else stages[0], self.pipe.m,
                             loss_fn=next_token_loss)
        self.meter = TrafficMeter(modelled=True)
        self.step_bytes = theory.link_bytes(cfg, theory.layout(cfg), self.stage)

    def _groups(self) -> tuple[Any, Any]:
        """This rank's pipeline group and data-parallel group (None where it is the world or a single rank);
        every rank makes every group, in the same order."""
        p, dp = self.pipe.p, self.dp
        if dp == 1:
            return None, None
        pp = [dist.new_group([d * p + s for s in range(p)]) for d in range(dp)]
        data = [dist.new_group([d * p + s for d in range(dp)]) for s in range(p)]
        return pp[self.dp_rank], data[self.stage]

    def step(self, batch: torch.Tensor) -> StepStats:
        self.flat.zero_grad()
        losses: list[torch.Tensor] = []
        first, last = self.stage == 0, self.stage == self.pipe.p - 1
        args = (batch[:, :-1],) if first else ()
        kwargs = {"target": batch[:, 1:], "losses": losses} if last else {}
        self.schedule.step(*args, **kwargs)
        t0 = time.perf_counter()
        if self.dp_group is not None:
            self.flat.grad.div_(self.dp)
            dist.all_reduce(self.flat.grad, group=self.dp_group)
        # the loss of the global batch on every rank: the last stages' means, summed over the world
        loss = torch.tensor([torch.stack(losses).double().mean().item() if last else 0.0], dtype=torch.float64)
        dist.all_reduce(loss)
        comm_s = time.perf_counter() - t0
        skipped = self.optim.step([self.flat.grad])
        self.meter.add("pipeline", int(self.step_bytes.sent), int(self.step_bytes.received))
        return StepStats(float(loss.item()) / self.dp, skipped=skipped, comm_s=comm_s)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        layouts = []
        for s in range(self.pipe.p):   # each stage's trained parameters, then its frozen ones
            trained = self._layout_of(s)
            end = sum(shape.numel() for _, shape, _ in trained)
            layouts.append(trained + [(n, x, o + end) for n, x, o in self._layout_of(s, self.frozen_shapes)])
        flat = torch.cat([self._master(), *[x.detach().reshape(-1).float() for x in self.frozen]])
        with self.meter.tagged("export"):
            values = gather_masters(P2P(self.ctx.group, self.meter), flat, self.stage, self.dp_rank, layouts)
        return {name: values[name] for name in self.names} if values is not None else {}

    def _layout_of(self, stage: int, shapes: dict[str, tuple[int, ...]] | None = None) -> list[tuple[str, torch.Size, int]]:
        """(name, shape, offset) of stage `stage`'s parameters (of `shapes`: by default those that train): its
        modules' order, which is the model's."""
        shapes = self.shapes if shapes is None else shapes
        held = set()
        for c in range(self.pipe.v):
            j = self.pipe.stage_of(stage, c)
            prefixes = ["embed.", "pos."] * (j == 0) + [f"blocks.{i}." for i in self.ranges[j]] + \
                ["ln_f.", "head."] * (j == self.pipe.virtual - 1)
            held |= {n for n in shapes if n.startswith(tuple(prefixes))}
        return layout_of(shapes, held)

    def _master(self) -> torch.Tensor:
        return self.optim.master.params[0].detach().view(-1)

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        frags = master_fragments(self.optim, 0, self.layout, 0, self.flat.numel)
        return Pieces(share_of(frags, self.dp_rank, self.dp) if writing else frags, dict(self.shapes),
                      scaler_state(self.optim.scaler))

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        restore_optimizer(self.optim, ckpt, lambda: master_fragments(self.optim, 0, self.layout, 0, self.flat.numel))

    def memory(self) -> MemoryReport:
        return flat_memory(self.ctx.device, self.flat, self.optim.state_bytes())

    def traffic(self) -> TrafficReport:
        return self.meter.report()

    def close(self) -> None:
        pass
