"""What theory predicts for ZeRO (Rajbhandari et al. 2020) and PyTorch's own sharded peers: memory by
category from the stage (Table 1's cells, psarch/theory.sharded_memory) and ring passes per step: stages 1-2
reduce-scatter gradients and all-gather parameters (2 passes, 2(N−1)/N · S), stage 3 all-gathers in forward,
again in backward, and reduce-scatters (3 passes). torch_zero is DDP's full all-reduce (2 passes) plus
ZeroRedundancyOptimizer's broadcast of each updated shard (an all-gather's volume, 1 pass) over ZeRO-1
memory; torch_fsdp (FSDP2) is ZeRO-3."""
from __future__ import annotations

from typing import TYPE_CHECKING

from psarch.theory import Prediction, ring_passes, sharded_memory

if TYPE_CHECKING:
    from psarch.config import Config


def passes(stage: int) -> int:
    """Ring passes per step of psarch's ZeRO at `stage`."""
    return 3 if stage == 3 else 2


def zero(cfg: Config, phi: float, stage: int, ring: int) -> Prediction:
    """ZeRO-`stage` memory with `ring` ring passes per step."""
    return ring_passes(sharded_memory(cfg, phi, stage), cfg, phi, ring)
