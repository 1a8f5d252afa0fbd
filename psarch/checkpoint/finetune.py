"""Fine-tuning from a trained checkpoint: a config with LoRA adapters or frozen parameters (train.lora_rank,
train.trainable) started `--from` a checkpoint of the base model (every parameter of the config's model before
adapters and freezing, by name and shape) takes its weights by name; adapters start as LoRA initialises them,
the optimizer state fresh, at step 0 (a new run: its train.steps, schedule and data count the fine-tuning)."""
from __future__ import annotations

import torch
from torch import nn

from psarch import registry
from psarch.checkpoint.fragments import PARAM
from psarch.checkpoint.reader import Checkpoint, CheckpointError
from psarch.config import Config

ADAPTERS = ("lora_A", "lora_B")


def fine_tunes(cfg: Config) -> bool:
    """Whether the config trains a subset of its model (adapters added or parameters frozen)."""
    return bool(cfg.train.lora_rank or cfg.train.trainable)


def base_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The model's parameters without its adapters (name -> shape): the base model a full run trained."""
    return {n: tuple(p.shape) for n, p in model.named_parameters() if n.rpartition(".")[2] not in ADAPTERS}


def is_base_start(cfg: Config, ckpt: Checkpoint, model: nn.Module) -> bool:
    """Whether `ckpt` is the base model's checkpoint for a fine-tuning config: it holds every base parameter
    (names and shapes) and is not a checkpoint of the config's own trainable set (that one resumes or forks as
    any other). Raises CheckpointError naming what is missing on a backend not in BACKENDS."""
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    if not fine_tunes(cfg) or set(ckpt.params) == trains:
        return False
    base = base_shapes(model)
    if set(ckpt.params) != set(base) or any(list(s) != ckpt.params[n]["shape"] for n, s in base.items()):
        return False
    spec = registry.spec_of(cfg)
    if not spec.fine_tunes_from_base:   # e.g. PS servers restore their shards from the checkpoint
        kinds = [s.kind for s in registry.specs() if s.fine_tunes_from_base]
        raise CheckpointError(f"--from {ckpt.path}: a base model's checkpoint into a LoRA or frozen config is loaded "
                              f"on backend.kind = {', '.join(kinds)} only; {cfg.backend.kind!r} has no base-weight "
                              f"load yet (its model is not built from the rank's workload alone; start it from a "
                              f"checkpoint of its own trainable set)")
    if not spec.worker_holds_tables(cfg):
        raise CheckpointError(f"--from {ckpt.path}: a base model's checkpoint is loaded into the ranks' models, but "
                              f"with backend.embeddings = \"{cfg.backend.embeddings}\" the tables are built where they "
                              f"live (PS servers, row shards) from the seed; fine-tune with embeddings = \"dense\"")
    return True


def load_base(model: nn.Module, ckpt: Checkpoint) -> None:
    """Copy the checkpoint's fp32 weights by name into the model's base parameters (before a backend builds
    its buffers from them); adapters are left as LoRA initialised them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ckpt.params:
                numel = ckpt.params[name]["numel"]
                p.copy_(ckpt.read(name, PARAM, 0, numel).view(p.shape))


def restore_base(cfg: Config, model: nn.Module) -> None:
    """A resumed fine-tune: its checkpoints hold only what trains, so the frozen weights are read again from the
    base checkpoint it started from (config started_from), not drawn from the seed."""
    path = cfg.started_from.get("path")
    if not fine_tunes(cfg) or path is None:
        return
    try:
        base = Checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"--resume: the fine-tune's base checkpoint is unreadable, so its frozen weights cannot "
                              f"be restored ({e})") from None
    try:
        if is_base_start(cfg, base, model):
            load_base(model, base)
    finally:
        base.close()
