"""The one place the core names backends: `backend.kind` -> trainer class, imported on first use."""
from __future__ import annotations

import importlib

from psarch.trainer import Trainer

BACKENDS = {
    "single": "psarch.single:SingleTrainer",
    "ddp": "collective.ddp:DDPTrainer",
    "zero": "zero.trainer:ZeroTrainer",
    "ps": "psarch.ps.worker:PSWorker",
    # PyTorch's own implementations, run by the same runner: the peers for parity and benchmarks
    "torch_ddp": "collective.torch_ddp:TorchDDPTrainer",
    "torch_zero": "zero.torch_peers:TorchZeroTrainer",     # DDP + ZeroRedundancyOptimizer (ZeRO-1)
    "torch_fsdp": "zero.torch_peers:TorchFSDPTrainer",     # FSDP2 fully_shard (ZeRO-3)
}


def trainer_class(kind: str) -> type[Trainer]:
    """The trainer class for a backend kind (a psarch.trainer.Trainer: its members say what the launcher
    and runner do for it, e.g. `start_services` for parameter servers)."""
    if kind not in BACKENDS:
        raise ValueError(f"backend.kind = {kind!r}: allowed values are {', '.join(BACKENDS)}")
    module, _, name = BACKENDS[kind].partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise RuntimeError(f"backend.kind = {kind!r}: its implementation ({BACKENDS[kind]}) is not available: {e}") from e
    if Trainer not in cls.__mro__:  # the launcher reads the contract's members (and their defaults) from Trainer
        raise RuntimeError(f"backend.kind = {kind!r}: {BACKENDS[kind]} does not subclass psarch.trainer.Trainer")
    return cls
