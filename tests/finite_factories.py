"""Workloads whose loss stays finite while their gradients do not, for tests/test_non_finite_grads.py."""
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
