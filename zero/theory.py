"""What theory predicts for ZeRO (Rajbhandari et al. 2020) and PyTorch's own sharded peers: memory by
category from the stage (Table 1's cells, psarch/theory.sharded_memory) and ring passes per step: stages 1-2
reduce-scatter gradients and all-gather parameters (2 passes, 2(N−1)/N · S), stage 3 all-gathers in forward,
again in backward, and reduce-scatters (3 passes); with train.compression = "fp16"/"bf16" the reduce-scatter's pass
carries 2 bytes per element (zero/wire.py: the gradients cast, the parameters' all-gathers not). torch_zero is DDP's
full all-reduce (2 passes, both in 2 bytes under torch's fp16/bf16_compress_hook) plus ZeroRedundancyOptimizer's
broadcast of each updated shard (an all-gather's volume, 1 pass) over ZeRO-1 memory; torch_fsdp (FSDP2) is ZeRO-3,
its reduce-scatter in 2 bytes under MixedPrecisionPolicy(reduce_dtype=...). Under ZeRO-3 and FSDP2 the frozen weights
(train.trainable, LoRA's base) are sharded too: a rank keeps its part of them and all-gathers them with their unit, in
forward and again in backward, and never reduce-scatters them, but for the units backward never reaches
(backward_reaches: nothing trains in them or before them), gathered in forward only (FSDP2: unless the unit after them
prefetches them, fsdp2_unreached); stages 1-2 and torch_zero keep them whole (psarch.theory.predict)."""
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


def zero(cfg: Config, phi: float, stage: int, ring: int, gradient_passes: int = 1) -> Prediction:
    """ZeRO-`stage` memory with `ring` ring passes per step, `gradient_passes` of them the gradients' (psarch's
    reduce-scatter; torch_zero's DDP all-reduce, 2): in gradient_width's bytes, (N−1)/N · Φ · 2 each where
    train.compression casts."""
    p = ring_passes(sharded_memory(cfg, phi, stage), cfg, phi, ring)
    n, saved = cfg.backend.world_size, BYTES[cfg.train.precision] - gradient_width(cfg)
    if p.rounds and saved:
        v = p.link.sent - gradient_passes * (n - 1) / n * phi * saved
        p.nodes["worker"].link = LinkBytes(v, v)
    return p


_UNITS: dict[str, tuple[list[tuple[int, int]], list[bool]]] = {}   # by what decides them: the estimator asks at every N


def _units(cfg: Config) -> tuple[list[tuple[int, int]], list[bool]]:
    """unit_sizes and backward_reaches, from the model built on the meta device (once per model and subset)."""
    from psarch.config.backend import units_attr
    from psarch.theory import table_params

    t, b = cfg.train, cfg.backend
    key = repr((cfg.workload, t.trainable, t.lora_rank, t.lora_targets, units_attr(b), b.embeddings))
    if key not in _UNITS:
        from psarch.model_units import find_units
        from psarch.workload import theory_model

        model = theory_model(cfg)
        units = find_units(model, units_attr(b), frozen_too=True)
        sizes = [(sum(p.numel() for p in u.params), sum(p.numel() for p in u.frozen)) for u in units]
        if b.embeddings == "ps":
            sizes[0] = (sizes[0][0] - int(table_params(cfg)), sizes[0][1])
        order = {id(p): k for k, p in enumerate(model.parameters())}
        first = min((order[id(p)] for u in units[1:] for p in [*u.params, *u.frozen]), default=len(order))
        flowing = any(order[id(p)] < first for p in units[0].params)   # the embeddings train
        reached = [True]   # the root: the head's backward starts it
        for u in units[1:]:   # once a block trains, backward goes through every block after it
            flowing = flowing or bool(u.params)
            reached.append(flowing)
        _UNITS[key] = (sizes, reached)
    return _UNITS[key]


def unit_sizes(cfg: Config) -> list[tuple[int, int]]:
    """(trainable, frozen) parameters of each unit, root first (psarch.model_units.find_units with frozen_too: the
    units ZeRO-3 gathers and FSDP2 shards one by one); with the tables on PS servers (embeddings = "ps") the root's
    trainable ones without the tables, which leave the model before its units are found (zero/trainer.py)."""
    return list(_units(cfg)[0])


def backward_reaches(cfg: Config) -> list[bool]:
    """Whether backward reaches each unit of unit_sizes (zero/stage3.py gathers no other in backward): the root
    always; a block once it trains, or a block before it does, or a root parameter registered before the blocks
    (the embeddings, upstream of them) trains. Registration order stands for the order of execution, as in the
    built-in models; the trainer decides from its forward's outputs, which require grad exactly there."""
    return list(_units(cfg)[1])


def unit_shares(cfg: Config) -> list[float]:
    """Each unit's share of the trainable parameters, root first, units with none left out."""
    sizes = [float(t) for t, _ in unit_sizes(cfg)]
    total = sum(sizes) or 1.0
    return [sizes[0] / total] + [x / total for x in sizes[1:] if x]


def trains_a_subset(cfg: Config) -> bool:
    """Whether the config freezes parameters (train.trainable, LoRA): only then is a model built to count them."""
    return bool(cfg.train.trainable or cfg.train.lora_rank)


def zero3_frozen_chunks(cfg: Config, reached_only: bool = False) -> int:
    """Frozen elements one ZeRO-3 rank keeps: its chunk of each unit's frozen weights, each unit padded to N
    (zero.partition; zero/frozen.py); reached_only: of the units backward reaches, those gathered again there."""
    if not trains_a_subset(cfg):
        return 0
    n = cfg.backend.world_size
    kept = backward_reaches(cfg) if reached_only else [True] * len(unit_sizes(cfg))
    return sum(padded_size(f, n) // n for (_, f), keep in zip(unit_sizes(cfg), kept) if f and keep)


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


def with_sharded_frozen(p: Prediction, cfg: Config, held: float, forward_sent: float,
                        backward_sent: float) -> Prediction:
    """`p` with frozen weights sharded: `held` elements on each rank (its memory's frozen category), all-gathered
    with their units in forward (sending `forward_sent` elements per rank and receiving as many) and again in
    backward, where it reaches them (`backward_sent`); no gradient, optimizer state or reduce-scatter."""
    width, n = BYTES[cfg.train.precision], cfg.backend.world_size
    p.memory_per_rank.frozen = width * held
    if n > 1 and held:
        v = width * (forward_sent + backward_sent)
        p.nodes["worker"].link = LinkBytes(p.link.sent + v, p.link.received + v)
        p.messages += (n - 1) * ((forward_sent > 0) + (backward_sent > 0))   # one more all-gather beside a pass's
    return p


def zero3_frozen(p: Prediction, cfg: Config) -> Prediction:
    """psarch's ZeRO-3: each rank's chunks of the frozen groups, N - 1 chunks sent per all-gather (padding included,
    as the ring sends it): all of them in forward, in backward those of the units it reaches (zero/stage3.py)."""
    n = cfg.backend.world_size
    return with_sharded_frozen(p, cfg, zero3_frozen_chunks(cfg), (n - 1) * zero3_frozen_chunks(cfg),
                               (n - 1) * zero3_frozen_chunks(cfg, reached_only=True))


def fsdp2_unreached(cfg: Config) -> list[bool]:
    """Whether FSDP2 leaves each unit (root first) ungathered in backward for want of a backward: a block backward
    does not reach (backward_reaches), unless the block after it is reached, whose pre-backward prefetches the one
    before it (tests/test_zero3_backward_reach.py counts FSDP2's own all-gathers; zero/program.fsdp_script)."""
    reached = backward_reaches(cfg)
    return [False] + [not (r or after) for r, after in zip(reached[1:], reached[2:] + [False])]


def fsdp2_unreached_frozen(cfg: Config) -> int:
    """Frozen elements of the units fsdp2_unreached names: all-gathered in forward only."""
    if not trains_a_subset(cfg):
        return 0
    return sum(f for (_, f), skip in zip(unit_sizes(cfg), fsdp2_unreached(cfg)) if skip)


def fsdp2_frozen(p: Prediction, cfg: Config) -> Prediction:
    """torch_fsdp: FSDP2's padded rows held; its all-gathers modelled as its trainable ones are (TorchFSDPTrainer's
    meter), (N - 1)/N of the frozen elements per pass, the backward's without fsdp2_unreached_frozen."""
    n, frozen = cfg.backend.world_size, sum(math.prod(s) for s in _frozen_shapes(cfg))
    return with_sharded_frozen(p, cfg, fsdp2_frozen_rows(cfg), (n - 1) / n * frozen,
                               (n - 1) / n * (frozen - fsdp2_unreached_frozen(cfg)))
