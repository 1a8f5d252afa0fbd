"""The single-process data-parallel backends, declared (psarch/backend.py): `dp` (psarch/dp/trainer.py) and
`torch_dp` (torch.nn.DataParallel, the peer), with their theory: the master sends the trainable parameters to
each of the N - 1 other devices and receives their gradients, (N - 1) S each way per step (plus the scattered
inputs and gathered outputs, which are the workload's, not the model's), and holds the model states while each
replica holds parameters and gradients."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psarch.backend import BackendSpec
from psarch.errors import ConfigError
from psarch.theory import BYTES, LinkBytes, Prediction, sharded_memory

if TYPE_CHECKING:
    from psarch.config import Config


def master_prediction(cfg: Config, phi: float) -> Prediction:
    """The master device's copies per step (replicate, then the gradients reduced onto it), and the process's
    memory: the master's model states and N - 1 replicas' parameters and gradients."""
    n, s = cfg.backend.world_size, phi * BYTES[cfg.train.precision]
    mem = sharded_memory(cfg, phi, 0)
    mem.params, mem.grads = n * mem.params, n * mem.grads
    v = (n - 1) * s
    return Prediction.alike(mem, LinkBytes(v, v), 1, rounds=2 if n > 1 else 0, messages=2 * (n - 1), role="process")


class _OneProcess(BackendSpec):
    """What both share: one process whose workers are threads, on one machine; its checkpoint is the master's
    state, written as that process's one part."""

    needs_process_group = False

    def processes(self, cfg: Config) -> int:
        return 1

    def frozen_copies(self, cfg: Config) -> int:
        return cfg.backend.world_size

    def check(self, cfg: Config) -> None:
        c = cfg.cluster
        if c.emulate or c.slow_workers or c.jitter:
            key = ("cluster.emulate = true" if c.emulate else
                   f"cluster.slow_workers = {c.slow_workers}" if c.slow_workers else f"cluster.jitter = {c.jitter:g}")
            raise ConfigError(f"{key}: backend.kind = \"{self.kind}\" runs its workers as threads of one process on "
                              f"one machine, which has no links and no worker of its own to slow")

    def predict(self, cfg: Config, phi: float) -> Prediction:
        return master_prediction(cfg, phi)

    def program(self, cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
        """psarch/dp/program.py's step: the master's copies out and the gradients back."""
        from psarch.dp.program import dp_program
        return dp_program(cfg.backend.world_size, phi * BYTES[cfg.train.precision], step, reduced)


class DPSpec(_OneProcess):
    kind = "dp"
    trains_subsets = True
    fine_tunes_from_base = True
    trainer = "psarch.dp.trainer:DPTrainer"
    doc = ("one process, one thread per device (torch.nn.DataParallel's step, written out): the module replicated "
           "from the master each step, inputs scattered, outputs and gradients gathered on the master")


class TorchDPSpec(_OneProcess):
    kind = "torch_dp"
    trainer = "psarch.dp.torch_dp:TorchDPTrainer"
    doc = "PyTorch's DataParallel (the peer of dp; CUDA devices only)"

    def check(self, cfg: Config) -> None:
        super().check(cfg)
        if cfg.backend.device == "cpu":
            raise ConfigError("backend.device = \"cpu\": backend.kind = \"torch_dp\" is torch.nn.DataParallel, which "
                              "runs on CUDA devices only; use backend.kind = \"dp\" on CPU cores")


DP = DPSpec()
TORCH_DP = TorchDPSpec()
