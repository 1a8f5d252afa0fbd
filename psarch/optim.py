"""The optimizers every backend uses, built from `[train]` with the same hyper-parameters everywhere."""
from __future__ import annotations

from typing import Iterable

import torch

from psarch.config import TrainConfig


def build_optimizer(params: Iterable[torch.Tensor], t: TrainConfig) -> torch.optim.Optimizer:
    """SGD (momentum, Nesterov, weight decay), AdamW or Adagrad (L2 weight decay), on fp32 tensors.

    foreach=False keeps one kernel per tensor, so a flat buffer and per-parameter tensors see the same
    element-wise arithmetic (parity between backends is then summation order alone)."""
    params = list(params)
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, nesterov=t.nesterov,
                               weight_decay=t.weight_decay, foreach=False)
    if t.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=t.lr, eps=t.eps, weight_decay=t.weight_decay,
                                   initial_accumulator_value=t.initial_accumulator_value, foreach=False)
    return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps,
                             weight_decay=t.weight_decay, foreach=False)
