"""Workloads for the trust tests: a loss that stays finite while its gradients do not (tests/test_non_finite_grads.py),
L2 terms read outside the model's forward (tests/test_zero3_reads.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import psarch
from factories import regression


class NanGradAt(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by NaN where `poison` is set."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(poison)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (poison,) = ctx.saved_tensors
        return torch.where(poison, torch.full_like(grad, float("nan")), grad), None


def nan_grad_on_last_shard_at_last_step(cfg) -> psarch.Workload:
    """Regression whose last shard's gradient (worker N-1's, every parameter's) is NaN at the last step while
    its loss stays finite."""
    wl = regression(cfg)
    last = cfg.train.steps - 1

    def batch(step: int, shard: int, num_shards: int):
        x, y = wl.batch(step, shard, num_shards)
        return x, y, torch.tensor((step, shard) == (last, num_shards - 1))

    def loss_fn(model: nn.Module, b) -> torch.Tensor:
        x, y, poison = b
        out = NanGradAt.apply(model(x.to(next(model.parameters()).dtype)), poison)
        return F.mse_loss(out.squeeze(-1).float(), y.float())

    return psarch.Workload(wl.model, loss_fn, batch, wl.entropy_floor, "nan-grad-at-last-step")



class BlockRegressor(nn.Module):
    """Regression through two blocks (ZeRO-3's units, zero_units = "blocks") and a head in the root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 16), nn.Tanh()),
                                     nn.Sequential(nn.Linear(16, 16), nn.Tanh())])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _with_l2(cfg, some: bool) -> psarch.Workload:
    wl = regression(cfg)

    def loss_fn(model: BlockRegressor, b) -> torch.Tensor:
        if not some:   # the term: every parameter, read after the forward
            return wl.loss_fn(model, b) + 0.01 * sum(p.pow(2).sum() for p in model.parameters())
        before = model.blocks[0][0].weight.pow(2).sum()   # read before the forward
        loss = wl.loss_fn(model, b)
        return loss + 0.01 * (before + model.head.weight.pow(2).sum())

    return psarch.Workload(BlockRegressor(), loss_fn, wl.batch, wl.entropy_floor, "regression-l2")


def l2_on_every_parameter(cfg) -> psarch.Workload:
    """Regression plus an L2 term over every parameter, read in loss_fn after the model's forward."""
    return _with_l2(cfg, some=False)


def l2_on_some_parameters(cfg) -> psarch.Workload:
    """Regression plus an L2 term on the first block's weight (read before the forward) and the head's (after):
    ZeRO-3's second block is read by the forward alone."""
    return _with_l2(cfg, some=True)
