"""What theory predicts for ZeRO (Rajbhandari et al. 2020) and PyTorch's own sharded peers: memory by
category from the stage (Table 1's cells, psarch/theory.sharded_memory) and ring passes per step: stages 1-2
reduce-scatter gradients and all-gather parameters (2 passes, 2(N−1)/N · S), stage 3 all-gathers in forward,
again in backward, and reduce-scatters (3 passes); with train.compression = "fp16"/"bf16" the reduce-scatter's pass
carries 2 bytes per element (zero/wire.py: the gradients cast, the parameters' all-gathers not). torch_zero is DDP's full all-reduce (2 passes) plus
ZeroRedundancyOptimizer's broadcast of each updated shard (an all-gather's volume, 1 pass) over ZeRO-1
memory; torch_fsdp (FSDP2) is ZeRO-3. Under ZeRO-3 and FSDP2 the frozen weights (train.trainable, LoRA's base) are
sharded too: a rank keeps its part of them and all-gathers them with their unit, in forward and again in backward,
and never reduce-scatters them; stages 1-2 and torch_zero keep them whole (psarch.theory.predict)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from psarch.theory import BYTES, LinkBytes, Prediction, ring_passes, sharded_memory

if TYPE_CHECKING:
    from psarch.config import Config


def padded_size(numel: int, world_size: int) -> int:
    """A group of `numel` elements padded to a multiple of `world_size` (an empty group still moves one chunk):
    what zero/partition.py shards, here where theory reads it without torch."""
    return max(-(-numel // world_size), 1) * world_size


def passes(stage: int) -> int:
    """Ring passes per step of psarch's ZeRO at `stage`."""
    return 3 if stage == 3 else 2


def gradient_width(cfg: Config) -> int:
    """Bytes per gradient element in ZeRO's reduce-scatter: 2 where train.compression casts (zero/wire.py), else
    the compute dtype's."""
    t = cfg.train
    return BYTES[t.compression] if t.compression in ("fp16", "bf16") else BYTES[t.precision]


def zero(cfg: Config, phi: float, stage: int, ring: int) -> Prediction:
    """ZeRO-`stage` memory with `ring` ring passes per step, one of them the gradients' reduce-scatter: in
    gradient_width's bytes, (N−1)/N · Φ · 2 where train.compression casts."""
    p = ring_passes(sharded_memory(cfg, phi, stage), cfg, phi, ring)
    n, saved = cfg.backend.world_size, BYTES[cfg.train.precision] - gradient_width(cfg)
    if p.rounds and saved:
        v = p.worker.sent - (n - 1) / n * phi * saved
        p.worker = LinkBytes(v, v)
    return p


_SIZES: dict[str, list[tuple[int, int]]] = {}   # unit_sizes by what decides them: the estimator asks at every N


def unit_sizes(cfg: Config) -> list[tuple[int, int]]:
    """(trainable, frozen) parameters of each unit, root first (psarch.model_units.find_units with frozen_too: the
    units ZeRO-3 gathers and FSDP2 shards one by one), from the model built on the meta device; with the tables on
    PS servers (embeddings = "ps") the root's trainable ones without the tables, which leave the model before its
    units are found (zero/trainer.py)."""
    from psarch.config.backend import units_attr
    from psarch.theory import table_params

    t, b = cfg.train, cfg.backend
    key = repr((cfg.workload, t.trainable, t.lora_rank, t.lora_targets, units_attr(b), b.embeddings))
    if key not in _SIZES:
        from psarch.model_units import find_units
        from psarch.workload import theory_model

        units = find_units(theory_model(cfg), units_attr(b), frozen_too=True)
        sizes = [(sum(p.numel() for p in u.params), sum(p.numel() for p in u.frozen)) for u in units]
        if b.embeddings == "ps":
            sizes[0] = (sizes[0][0] - int(table_params(cfg)), sizes[0][1])
        _SIZES[key] = sizes
    return list(_SIZES[key])


def unit_shares(cfg: Config) -> list[float]:
    """Each unit's share of the trainable parameters, root first, units with none left out."""
    sizes = [float(t) for t, _ in unit_sizes(cfg)]
    total = sum(sizes) or 1.0
    return [sizes[0] / total] + [x / total for x in sizes[1:] if x]


def trains_a_subset(cfg: Config) -> bool:
    """Whether the config freezes parameters (train.trainable, LoRA): only then is a model built to count them."""
    return bool(cfg.train.trainable or cfg.train.lora_rank)


def zero3_frozen_chunks(cfg: Config) -> int:
    """Frozen elements one ZeRO-3 rank keeps: its chunk of each unit's frozen weights, each unit padded to N
    (zero.partition; zero/frozen.py)."""
    n = cfg.backend.world_size
    return sum(padded_size(f, n) // n for _, f in unit_sizes(cfg) if f) if trains_a_subset(cfg) else 0


def _frozen_shapes(cfg: Config) -> list[tuple[int, ...]]:
    """The shapes of the config's frozen parameters (none unless it trains a subset), from the meta model."""
    if not trains_a_subset(cfg):
        return []
    from psarch.workload import theory_model

    return [tuple(p.shape) for p in theory_model(cfg).parameters() if not p.requires_grad]


def fsdp2_frozen_rows(cfg: Config) -> int:
    """Frozen elements one FSDP2 rank keeps: of each frozen parameter, torch.chunk's first part of dim 0 (ceil(d0/N)
    rows: FSDP2 pads every rank's shard to it)."""
    n = cfg.backend.world_size
    return sum(-(-s[0] // n) * math.prod(s[1:]) if s else 1 for s in _frozen_shapes(cfg))


def with_sharded_frozen(p: Prediction, cfg: Config, held: float, pass_sent: float) -> Prediction:
    """`p` with frozen weights sharded: `held` elements on each rank (its memory's frozen category), all-gathered
    with their units in forward and again in backward (2 passes, each sending `pass_sent` elements per rank and
    receiving as many); no gradient, optimizer state or reduce-scatter."""
    width, n = BYTES[cfg.train.precision], cfg.backend.world_size
    p.memory_per_rank.frozen = width * held
    if n > 1 and held:
        v = 2 * width * pass_sent
        p.worker = LinkBytes(p.worker.sent + v, p.worker.received + v)
        p.messages += 2 * (n - 1)   # one more all-gather beside each pass's (one unit)
    return p


def zero3_frozen(p: Prediction, cfg: Config) -> Prediction:
    """psarch's ZeRO-3: each rank's chunks of the frozen groups, N - 1 chunks sent per all-gather (padding included,
    as the ring sends it)."""
    held = zero3_frozen_chunks(cfg)
    return with_sharded_frozen(p, cfg, held, (cfg.backend.world_size - 1) * held)


def fsdp2_frozen(p: Prediction, cfg: Config) -> Prediction:
    """torch_fsdp: FSDP2's padded rows held; its all-gathers modelled as its trainable ones are (TorchFSDPTrainer's
    meter), (N - 1)/N of the frozen elements per pass."""
    n, frozen = cfg.backend.world_size, sum(math.prod(s) for s in _frozen_shapes(cfg))
    return with_sharded_frozen(p, cfg, fsdp2_frozen_rows(cfg), (n - 1) / n * frozen)
