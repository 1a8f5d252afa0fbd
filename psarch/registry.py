"""The one place the core names backends: `backend.kind` -> trainer class, imported on first use."""
from __future__ import annotations

import importlib

BACKENDS = {
    "single": "psarch.single:SingleTrainer",
    "ddp": "collective.ddp:DDPTrainer",
    "zero": "zero.trainer:ZeroTrainer",
    "ps": "psarch.ps.trainer:PSTrainer",
    # PyTorch's own implementations, run by the same runner: the peers for parity and benchmarks
    "torch_ddp": "collective.torch_ddp:TorchDDPTrainer",
    "torch_zero": "zero.torch_peers:TorchZeroTrainer",     # DDP + ZeroRedundancyOptimizer (ZeRO-1)
    "torch_fsdp": "zero.torch_peers:TorchFSDPTrainer",     # FSDP2 fully_shard (ZeRO-3)
}


def trainer_class(kind: str) -> type:
    """The trainer class for a backend kind. A trainer class may also define
    `start_services(cfg, out_dir) -> Services` (e.g. parameter servers) that the launcher runs first."""
    if kind not in BACKENDS:
        raise ValueError(f"backend.kind = {kind!r}: allowed values are {', '.join(BACKENDS)}")
    module, _, name = BACKENDS[kind].partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise RuntimeError(f"backend.kind = {kind!r}: its implementation ({BACKENDS[kind]}) is not available: {e}") from e
