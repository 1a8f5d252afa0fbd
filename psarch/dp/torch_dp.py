"""`torch_dp`: torch.nn.DataParallel itself, the peer of `dp`, on CUDA devices cuda:0..N-1. The master is the
`single` trainer on cuda:0; DataParallel wraps its model, so the workload's loss function calls the wrapper,
which scatters the inputs, replicates the module, runs the replicas in threads and gathers their outputs on
cuda:0, where the loss is computed. Its copies are inside torch: the bytes reported are the model's share,
(N - 1) S each way per step, marked modelled."""
from __future__ import annotations

from typing import Any

import torch

from psarch.config import Config
from psarch.dist import DistContext
from psarch.meters import TrafficMeter, tensor_bytes
from psarch.single import SingleTrainer
from psarch.trainer import StepStats, TrafficReport
from psarch.workload import Workload


class TorchDPTrainer(SingleTrainer):
    """SingleTrainer's step with the model wrapped in torch.nn.DataParallel."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        n = cfg.backend.world_size
        if ctx.device.type != "cuda" or torch.cuda.device_count() < n:
            raise RuntimeError(f"backend.world_size = {n}: backend.kind = \"torch_dp\" needs {n} CUDA devices, "
                               f"{torch.cuda.device_count()} are visible (torch.nn.DataParallel runs on CUDA only)")
        super().__init__(workload, cfg, ctx)
        self.dp = torch.nn.DataParallel(self.model, device_ids=list(range(n)))
        self.meter = TrafficMeter(modelled=True)
        self.n = n

    def step(self, batch: Any) -> StepStats:
        self.flat.zero_grad()
        loss = self.loss_fn(self.dp, batch)
        self.optim.scaler.scale_loss(loss).backward()
        skipped = self.optim.step([self.flat.grad])
        s = tensor_bytes([self.flat.data])
        self.meter.add("replicate", (self.n - 1) * s, 0, self.n - 1)
        self.meter.add("reduce", 0, (self.n - 1) * s, self.n - 1)
        return StepStats(float(loss.item()), skipped=skipped, loss_scale=self.optim.scaler.scale)

    def traffic(self) -> TrafficReport:
        return self.meter.report()
