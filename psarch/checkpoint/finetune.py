"""Fine-tuning from a trained checkpoint: a config with LoRA adapters or frozen parameters (train.lora_rank,
train.trainable) started `--from` a checkpoint of the base model (every parameter of the config's model before
adapters and freezing, by name and shape) takes its weights by name; adapters start as LoRA initialises them,
the optimizer state fresh, at step 0 (a new run: its train.steps, schedule and data count the fine-tuning)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from psarch import registry
from psarch.checkpoint.fragments import PARAM
from psarch.checkpoint.reader import Checkpoint, CheckpointError
from psarch.config import Config
from psarch.workload import build_workload

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
    any other). Raises CheckpointError where the backend has no base-weight load (BackendSpec.fine_tunes_from_base,
    base_embeddings)."""
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
    if cfg.backend.embeddings not in spec.base_embeddings:
        raise CheckpointError(f"--from {ckpt.path}: a base model's checkpoint is loaded into the ranks' models, but "
                              f"with backend.embeddings = \"{cfg.backend.embeddings}\" the tables are built where they "
                              f"live from the seed; fine-tune with embeddings = "
                              f"{' or '.join(json.dumps(e) for e in spec.base_embeddings)}")
    return True


def load_base(model: nn.Module, ckpt: Checkpoint) -> None:
    """Copy the checkpoint's fp32 weights by name into the model's base parameters (before a backend builds
    its buffers from them); adapters are left as LoRA initialised them, and tables left on the meta device to the
    services that hold them (base_embeddings)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ckpt.params and not p.is_meta:
                numel = ckpt.params[name]["numel"]
                p.copy_(ckpt.read(name, PARAM, 0, numel).view(p.shape))


def base_checkpoint(cfg: Config, model: nn.Module) -> Checkpoint | None:
    """The base model's checkpoint a fine-tune started from (config started_from; `model`, the config's, names
    what it must hold), opened; None for a run not started from one."""
    path = cfg.started_from.get("path")
    if not fine_tunes(cfg) or path is None:
        return None
    try:
        base = Checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"the fine-tune's base checkpoint is unreadable, so its frozen weights cannot be "
                              f"restored ({e})") from None
    try:
        if is_base_start(cfg, base, model):
            return base
    except BaseException:
        base.close()
        raise
    base.close()
    return None


def restore_base(cfg: Config, model: nn.Module) -> None:
    """A fine-tune's base weights where its ranks do not load them (a PS's servers, its model.pt) or not again (a
    resumed run, whose checkpoints hold only what trains): read from the base checkpoint the run started from,
    not drawn from the seed; nothing for a run not started from a base checkpoint."""
    base = base_checkpoint(cfg, model)
    if base is not None:
        try:
            load_base(model, base)
        finally:
            base.close()


def starts_from_base(cfg: Config, path: Path) -> bool:
    """Whether the checkpoint at `path` is a base model's checkpoint that a fine-tuning config starts from (a
    backend's services then build their state from it, as the ranks' models load it, instead of restoring it)."""
    if not fine_tunes(cfg):
        return False
    ckpt = Checkpoint(path)
    try:
        return is_base_start(cfg, ckpt, build_workload(cfg, device="meta").model)
    finally:
        ckpt.close()
