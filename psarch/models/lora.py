"""LoRA (Hu et al., ICLR '22): a linear layer W x + b keeps W frozen and learns a low-rank update,
W x + b + (alpha / r) B A x, A (r x in) drawn at random, B (out x r) zeros, so training starts from the
unchanged model. The adapted layer keeps the base layer's parameter names (weight, bias) and adds lora_A,
lora_B, so a model's state dict reads as the base model's plus the adapters."""
from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Linear):
    """nn.Linear plus a rank-r adapter; `scaling` = alpha / r."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator) -> None:
        w = base.weight
        # built on the meta device (nothing allocated, no generator drawn), then given the base layer's own tensors
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.scaling = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype))
        if w.device.type != "meta":
            # kaiming_uniform(a=sqrt(5)), as nn.Linear and peft initialise: uniform in +-1/sqrt(in)
            bound = 1 / math.sqrt(base.in_features)
            a = torch.rand(rank, base.in_features, generator=generator) * 2 * bound - bound
            with torch.no_grad():
                self.lora_A.copy_(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.scaling * F.linear(F.linear(x, self.lora_A), self.lora_B)


def add_lora(model: nn.Module, rank: int, alpha: float, targets: list[str], seed: int) -> list[str]:
    """Replace each nn.Linear whose name matches a pattern of `targets` by a LoRALinear (its A drawn from a
    generator seeded with `seed`, in module order, so every rank adds the same adapters); the names replaced."""
    generator = torch.Generator().manual_seed(seed)
    chosen = [name for name, m in model.named_modules()
              if type(m) is nn.Linear and any(fnmatch.fnmatchcase(name, t) for t in targets)]
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, generator))
    return chosen
