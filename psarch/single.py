"""The `single` backend: one process, the whole global batch, plain PyTorch. The reference."""
from __future__ import annotations

from typing import Any

import torch

from psarch.checkpoint.fragments import Pieces, master_fragments, restore_optimizer, scaler_state
from psarch.config import Config
from psarch.dist import DistContext
from psarch.flat import FlatParams, flat_layout
from psarch.meters import TrafficMeter, flat_memory
from psarch.precision import MixedPrecisionOptimizer, compute_dtype
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport, consolidated_state
from psarch.workload import Workload


class SingleTrainer(Trainer):
    """Forward, backward, optimizer step: nothing moves anywhere.

    Parameters and gradients are views into flat buffers (as in DDP), so zeroing the gradients, the
    optimizer step (one fused kernel) and, in bf16/fp16, the cast to and from the fp32 masters are one
    operation each, not one per parameter."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        self.ctx = ctx
        self.model = workload.model.to(ctx.device, compute_dtype(cfg.train.precision))
        self.loss_fn = workload.loss_fn
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.flat = FlatParams(self.params)
        self.optim = MixedPrecisionOptimizer([self.flat.data], cfg.train, cfg.train.precision)
        self._layout = flat_layout(self.model, self.flat.params)

    def step(self, batch: Any) -> StepStats:
        self.flat.zero_grad()
        loss = self.loss_fn(self.model, batch)
        self.optim.scaler.scale_loss(loss).backward()
        skipped = self.optim.step([self.flat.grad])
        return StepStats(float(loss.item()), skipped=skipped, loss_scale=self.optim.scaler.scale)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        masters = self.flat.views(self.optim.master.masters[0])
        return consolidated_state(self.model, {id(p): m for p, m in zip(self.flat.params, masters)})

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """Every parameter, from the one flat fp32 master."""
        return Pieces(self._fragments(), {n: tuple(shape) for n, shape, _ in self._layout},
                      scaler_state(self.optim.scaler))

    def _fragments(self) -> list:
        return master_fragments(self.optim, 0, self._layout, 0, self.flat.numel)

    def load_checkpoint(self, ckpt) -> None:
        restore_optimizer(self.optim, ckpt, self._fragments)

    def memory(self) -> MemoryReport:
        return flat_memory(self.ctx.device, self.flat, self.optim.state_bytes())

    def traffic(self) -> TrafficReport:
        return TrafficMeter().report()

    def close(self) -> None:
        pass
