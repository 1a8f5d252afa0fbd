"""The `single` backend, declared (psarch/backend.py): one process, the whole global batch (its trainer:
psarch/single.py)."""
from __future__ import annotations

from typing import Any

from psarch.backend import BackendSpec
from psarch.theory import Prediction, ring_passes, sharded_memory


class SingleSpec(BackendSpec):
    """The reference: one process, the whole global batch."""

    kind = "single"
    trainer = "psarch.single:SingleTrainer"
    doc = "one process, the whole global batch, plain PyTorch: the reference every backend is checked against"
    max_world_size = 1
    uncompressed_because = "one process: no gradient moves"
    bench_peer = "psarch.bench.step:plain_peer"
    needs_process_group = False   # one process: nothing to synchronise with
    trains_subsets = True
    fine_tunes_from_base = True

    def predict(self, cfg: Any, phi: float) -> Prediction:
        return ring_passes(sharded_memory(cfg, phi, 0), cfg, phi, 0)

    def program(self, cfg: Any, phi: float, step: Any, reduced: bool = False) -> Any:
        """One process computes the whole step: nothing moves."""
        from psarch.theory.program import WORKER, Program

        p = Program()
        p.compute("step", p.node(WORKER), step.forward_s + step.backward_s + step.optimizer_s)
        return p


SPEC = SingleSpec()
