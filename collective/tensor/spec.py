"""Tensor parallelism, declared (psarch/backend.py): `tensor` (psarch's Megatron split over the ring or native
communicator, with data parallelism beside it) and `torch_tensor` (torch.distributed.tensor.parallel, the peer)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from psarch.backend import PROCESS_GROUP_OPTIONS, BackendSpec
from psarch.config.backend import ActivationMemory, Communicator, CoreBackendConfig
from psarch.config.fields import option
from psarch.errors import ConfigError
from psarch.theory import Prediction


def _theory() -> ModuleType:
    """This backend's theory, imported when first asked: it needs torch, and a spec (read by config checks
    and `psarch keys`) must not."""
    from collective.tensor import theory
    return theory


if TYPE_CHECKING:
    from psarch.config import Config


@dataclass(frozen=True)
class TensorParallel(CoreBackendConfig):
    """The tensor-parallel degree: torch_tensor's [backend], and part of tensor's; the facts derived from it are
    properties, computed here only."""

    tensor_parallel: int = option(0, "ranks that split each GPT block's matrices (Megatron's tensor parallelism); "
                                     "world_size / tensor_parallel replicas of the split model train as data "
                                     "parallelism; 0: all of world_size", min=0)

    @property
    def tp_size(self) -> int:
        """t: the ranks of one tensor-parallel group."""
        return self.tensor_parallel or self.world_size

    @property
    def dp_size(self) -> int:
        """dp: the data-parallel replicas, each a tensor-parallel group."""
        return self.world_size // self.tp_size


@dataclass(frozen=True)
class TensorOptions(TensorParallel, Communicator, ActivationMemory):
    """tensor's [backend]: the degree, the communicator, measured activations."""


def check_gpt(cfg: Config, kind: str) -> None:
    """The built-in GPT, with heads, vocabulary and world size that split t ways; else one ConfigError."""
    w, b = cfg.workload, cfg.backend
    this = f"backend.kind = \"{kind}\" splits the built-in GPT's blocks (workload.model = \"gpt\")"
    if w.factory:
        raise ConfigError(f"workload.factory = {json.dumps(w.factory)}: {this}; a factory's model is not one "
                          f"it knows how to split (use ddp or zero)")
    if w.model != "gpt":
        raise ConfigError(f"workload.model = \"{w.model}\": {this}; \"{w.model}\" has no attention or MLP blocks "
                          f"to split (use ddp or zero)")
    t = b.tp_size
    if b.world_size % t:
        raise ConfigError(f"backend.tensor_parallel = {t}: must divide backend.world_size = {b.world_size} "
                          f"(world_size = data-parallel replicas x tensor_parallel)")
    if w.gpt.n_head % t:
        raise ConfigError(f"backend.tensor_parallel = {t}: must divide workload.gpt.n_head = {w.gpt.n_head} "
                          f"(each rank computes whole heads)")
    if w.data == "markov" and w.markov.vocab_size < t:
        raise ConfigError(f"backend.tensor_parallel = {t}: the vocabulary is split over the ranks, so it needs at "
                          f"least {t} tokens; workload.markov.vocab_size = {w.markov.vocab_size}")


class TensorSpec(BackendSpec):
    kind = "tensor"
    trains_subsets = True
    fine_tunes_from_base = True
    trainer = "collective.tensor.trainer:TensorTrainer"
    doc = "tensor parallelism (Megatron): GPT blocks split over tensor_parallel ranks, data parallelism beside it"
    options = TensorOptions
    reads = PROCESS_GROUP_OPTIONS
    precisions = ("fp32", "bf16")   # fp16 would need one inf/nan verdict over the tensor-parallel group

    def variant(self, cfg: Config) -> str:
        b = cfg.backend
        return f"t{b.tp_size}" + (f"xdp{b.dp_size}" if b.dp_size > 1 else "") + f"/{b.comm}"

    def label(self, cfg: Config) -> str:
        b = cfg.backend
        return f"tensor t={b.tp_size}" + (f" x dp={b.dp_size}" if b.dp_size > 1 else "") + f" {b.comm}"

    def check(self, cfg: Config) -> None:
        check_gpt(cfg, self.kind)

    def shrink_refusal(self, cfg: Config) -> str:
        return tensor_shrink_refusal(cfg, self.kind)

    def batch_shard(self, cfg: Config, rank: int, world_size: int) -> tuple[int, int]:
        return replica_shard(cfg, rank)

    def predict(self, cfg: Config, phi: float) -> Prediction:
        return _theory().tensor(cfg, phi)

    def program(self, cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
        return _theory().program(cfg, phi, step, reduced)


def tensor_shrink_refusal(cfg: Config, kind: str) -> str:
    """A tensor layout's world is tp_size x dp_size: N - 1 ranks hold no whole tensor-parallel group."""
    return (f"backend.kind = \"{kind}\" splits every layer over backend.tp_size ranks (backend.world_size = tp_size "
            f"x dp_size): N - 1 ranks hold no whole tensor-parallel group; use \"replace\"")


def replica_shard(cfg: Config, rank: int) -> tuple[int, int]:
    """The ranks of a tensor-parallel group (adjacent: collective/tensor/mesh.py) train on their replica's shard."""
    return rank // cfg.backend.tp_size, cfg.backend.dp_size


class TorchTensorSpec(BackendSpec):
    kind = "torch_tensor"
    trains_subsets = True
    fine_tunes_from_base = True
    trainer = "collective.tensor.torch_peer:TorchTensorTrainer"
    doc = "PyTorch's tensor parallelism (ColwiseParallel / RowwiseParallel, loss_parallel; the peer of tensor)"
    options = TensorParallel
    reads = PROCESS_GROUP_OPTIONS
    precisions = ("fp32",)

    def variant(self, cfg: Config) -> str:
        b = cfg.backend
        return f"t{b.tp_size}" + (f"xdp{b.dp_size}" if b.dp_size > 1 else "")

    def check(self, cfg: Config) -> None:
        check_gpt(cfg, self.kind)

    def shrink_refusal(self, cfg: Config) -> str:
        return tensor_shrink_refusal(cfg, self.kind)

    def batch_shard(self, cfg: Config, rank: int, world_size: int) -> tuple[int, int]:
        return replica_shard(cfg, rank)

    def predict(self, cfg: Config, phi: float) -> Prediction:
        return _theory().tensor(cfg, phi, torch_loss=True)

    def program(self, cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
        return _theory().program(cfg, phi, step, reduced, torch_loss=True)

    def compute_holds_waits(self, cfg: Config) -> bool:
        return True   # its collectives run inside DTensor's forward and backward and its step: nothing times them


TENSOR = TensorSpec()
TORCH_TENSOR = TorchTensorSpec()
