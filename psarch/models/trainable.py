"""Which parameters train (train.trainable, train.lora_*): LoRA adapters added where asked, every other parameter
frozen (requires_grad False). Backends step, hold optimizer state for and move only the parameters that
require gradients, so freezing here is all a backend needs."""
from __future__ import annotations

import fnmatch

from torch import nn

from psarch.config import Config, ConfigError
from psarch.models.lora import add_lora


def select_trainable(model: nn.Module, cfg: Config) -> None:
    """Add LoRA adapters (train.lora_rank > 0) and freeze what train.trainable does not name; a pattern that
    names nothing, or LoRA targets that match no linear layer, is a ConfigError."""
    t = cfg.train
    if t.lora_rank:
        if not add_lora(model, t.lora_rank, t.lora_alpha, t.lora_targets, cfg.seed):
            raise ConfigError(f"train.lora_targets = {t.lora_targets}: no nn.Linear module of the model matches; "
                              f"its linear layers are {_linear_names(model)}")
    if not t.trainable and not t.lora_rank:
        return
    names = [n for n, _ in model.named_parameters()]
    for pattern in t.trainable:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(f"train.trainable: {pattern!r} names no parameter of the model; its parameters are "
                              f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}")
    for name, p in model.named_parameters():
        adapter = t.lora_rank and name.rpartition(".")[2] in ("lora_A", "lora_B")
        p.requires_grad_(bool(adapter) or any(fnmatch.fnmatchcase(name, pat) for pat in t.trainable))


def _linear_names(model: nn.Module) -> str:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
