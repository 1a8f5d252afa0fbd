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


_SHARES: dict[str, list[float]] = {}   # unit_shares by what decides them: the estimator asks at every N


def unit_shares(cfg: Config) -> list[float]:
    """Each unit's share of the trainable parameters, root first (psarch.model_units.find_units: the units ZeRO-3
    gathers and FSDP2 shards one by one), from the model built on the meta device; with the tables on PS servers
    (backend.embeddings = "ps", the hybrid) of the dense ones, as the trainer's units hold them (the tables frozen
    placeholders, collective/ps_tables.py)."""
    from psarch.config.backend import units_attr

    t = cfg.train
    on_servers = getattr(cfg.backend, "embeddings", "dense") == "ps"
    key = repr((cfg.workload, t.trainable, t.lora_rank, t.lora_targets, units_attr(cfg.backend), on_servers))
    if key not in _SHARES:
        from psarch.embeddings import embedding_tables
        from psarch.model_units import find_units
        from psarch.workload import build_workload

        model = build_workload(cfg, device="meta").model
        for _, table in embedding_tables(model) if on_servers else []:
            table.weight.requires_grad_(False)
        units = find_units(model, units_attr(cfg.backend))
        sizes = [float(sum(p.numel() for p in u.params)) for u in units]
        total = sum(sizes) or 1.0
        _SHARES[key] = [sizes[0] / total] + [x / total for x in sizes[1:] if x]
    return list(_SHARES[key])
