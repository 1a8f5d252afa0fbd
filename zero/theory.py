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
(backward_reaches: no parameter that trains is used in them or upstream of them), gathered in forward only (FSDP2:
unless the unit after them prefetches them, fsdp2_backward_gathers); stages 1-2 and torch_zero keep them whole
(psarch.theory.predict). FSDP2 keeps its root gathered from forward through backward: its root moves in forward only
(fsdp2). A unit forward never runs (a block registered and unused: never_run) is neither all-gathered nor
reduce-scattered, by either (without_never_run)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from psarch.errors import ConfigError, show
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


_UNITS: dict[str, tuple[list[tuple[int, int]], list[bool], list[int]]] = {}   # the estimator asks at every N


def _units(cfg: Config) -> tuple[list[tuple[int, int]], list[bool], list[int]]:
    """unit_sizes, backward_reaches and forward_order, from one forward of the model on the meta device (once per
    model and subset; the global random state left as it was: a trainer reads the order too), where it trains a
    subset or is the user's own (a factory's)."""
    from psarch.config.backend import units_attr
    from psarch.theory import table_params

    t, b = cfg.train, cfg.backend
    key = repr((cfg.workload, t.trainable, t.lora_rank, t.lora_targets, units_attr(b), b.embeddings))
    if key not in _UNITS:
        import torch

        from psarch.model_units import ForwardReach, find_units, forward_reach
        from psarch.workload import theory_loss, theory_model

        # a built-in model training everything runs every block, in the order registered, and backward reaches each
        # (a meta forward costs seconds: torch imports its compiler for it); test_zero3_backward_reach checks this
        runs = trains_a_subset(cfg) or bool(cfg.workload.factory)
        with torch.random.fork_rng(devices=[]):   # a model's build seeds torch's generator
            model, loss = theory_loss(cfg) if runs else (theory_model(cfg), None)
            units = find_units(model, units_attr(b), frozen_too=True)
            try:
                ran = forward_reach(model, units, loss) if loss else ForwardReach([*range(1, len(units)), 0],
                                                                                  [True] * len(units))
            except Exception as e:   # a user's loss that cannot run once on its first batch shard here
                if not cfg.workload.factory:
                    raise
                raise ConfigError(f"workload.factory = {show(cfg.workload.factory)}: its loss did not run once on "
                                  f"rank 0's first batch shard, which gives ZeRO-3 and FSDP2 the order its forward "
                                  f"runs the units in: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        sizes = [(sum(p.numel() for p in u.params), sum(p.numel() for p in u.frozen)) for u in units]
        if b.embeddings == "ps":
            sizes[0] = (sizes[0][0] - int(table_params(cfg)), sizes[0][1])
        _UNITS[key] = (sizes, ran.reached, ran.order)
    return _UNITS[key]


def unit_sizes(cfg: Config) -> list[tuple[int, int]]:
    """(trainable, frozen) parameters of each unit, root first (psarch.model_units.find_units with frozen_too: the
    units ZeRO-3 gathers and FSDP2 shards one by one); with the tables on PS servers (embeddings = "ps") the root's
    trainable ones without the tables, which leave the model before its units are found (zero/trainer.py)."""
    return list(_units(cfg)[0])


def backward_reaches(cfg: Config) -> list[bool]:
    """Whether backward reaches each unit of unit_sizes (zero/stage3.py gathers no other in backward): whether the
    unit's output requires grad in a forward of the model on the meta device (_units, forward_reach), as
    the trainer decides from its own forward's outputs: a parameter that trains is used in the unit or upstream of
    it (a unit that never runs is not reached)."""
    return list(_units(cfg)[1])


def forward_order(cfg: Config) -> list[int]:
    """The units of unit_sizes in the order their forward ends in that forward (_units), the root last (left out: a
    unit that never runs): the order zero/stage3.py gathers and prefetches them in, as FSDP2 does (zero/trainer.py)."""
    return list(_units(cfg)[2])


def forward_runs(cfg: Config) -> list[bool]:
    """Whether that forward runs each unit of unit_sizes (the root always: the model's own forward)."""
    ran = set(forward_order(cfg))
    return [i == 0 or i in ran for i in range(len(unit_sizes(cfg)))]


def never_run(cfg: Config) -> tuple[int, int]:
    """(trainable, frozen) elements of the units forward never runs (a block registered and unused): neither
    zero/stage3.py nor FSDP2 all-gathers them, nor reduce-scatters their gradients (they get none)."""
    idle = [size for size, runs in zip(unit_sizes(cfg), forward_runs(cfg)) if not runs]
    return sum(t for t, _ in idle), sum(f for _, f in idle)


def without_never_run(p: Prediction, cfg: Config, phi: float) -> Prediction:
    """`p` (ZeRO-3's three passes over Φ = phi trainable elements) less those passes over the units forward never
    runs (never_run): two all-gathers in the compute dtype, one reduce-scatter in gradient_width's bytes."""
    idle = never_run(cfg)[0]
    if p.rounds and idle:
        n, trains = cfg.backend.world_size, sum(t for t, _ in unit_sizes(cfg)) or 1
        v = p.link.sent - (n - 1) / n * phi * idle / trains * (2 * BYTES[cfg.train.precision] + gradient_width(cfg))
        p.nodes["worker"].link = LinkBytes(v, v)
    return p


def unit_shares(cfg: Config) -> list[float]:
    """Each unit's share of the trainable parameters, root first, units with none left out."""
    sizes = [float(t) for t, _ in unit_sizes(cfg)]
    total = sum(sizes) or 1.0
    return [sizes[0] / total] + [x / total for x in sizes[1:] if x]


def trains_a_subset(cfg: Config) -> bool:
    """Whether the config freezes parameters (train.trainable, LoRA): only then is a model built to count them."""
    return bool(cfg.train.trainable or cfg.train.lora_rank)


def zero3_frozen_chunks(cfg: Config, kept: list[bool] | None = None) -> int:
    """Frozen elements one ZeRO-3 rank keeps: its chunk of each unit's frozen weights, each unit padded to N
    (zero.partition; zero/frozen.py); `kept`: of those units only (forward_runs: gathered in forward;
    backward_reaches: gathered again in backward)."""
    if not trains_a_subset(cfg):
        return 0
    n = cfg.backend.world_size
    kept = kept or [True] * len(unit_sizes(cfg))
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
    as the ring sends it): in forward those of the units it runs, in backward those of the units it reaches
    (zero/stage3.py)."""
    n = cfg.backend.world_size
    return with_sharded_frozen(p, cfg, zero3_frozen_chunks(cfg), (n - 1) * zero3_frozen_chunks(cfg, forward_runs(cfg)),
                               (n - 1) * zero3_frozen_chunks(cfg, backward_reaches(cfg)))


def fsdp2_backward_gathers(cfg: Config) -> list[bool]:
    """Whether FSDP2 all-gathers each unit (root first) in backward. Never the root: fully_shard keeps the root's
    parameters gathered from forward through backward (reshard_after_forward left None, FSDP2's lazy init makes it
    False for the root module: torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _lazy_init). A block where
    backward reaches it (backward_reaches), or where the block after it in forward's order is reached, whose
    pre-backward prefetches the one before it (tests/test_zero3_backward_reach.py counts FSDP2's own all-gathers;
    zero/program.fsdp_script)."""
    reached, order = backward_reaches(cfg), [i for i in forward_order(cfg) if i]
    after = dict(zip(order, order[1:]))
    return [False] + [r or (i in after and reached[after[i]]) for i, r in enumerate(reached[1:], 1)]


def fsdp2_forward_only(cfg: Config) -> tuple[int, int]:
    """(trainable, frozen) elements of the units FSDP2 all-gathers in forward only (fsdp2_backward_gathers): the
    root's, and the frozen weights of the blocks forward runs and backward neither reaches nor prefetches."""
    once = [(t, f) for (t, f), again, runs in zip(unit_sizes(cfg), fsdp2_backward_gathers(cfg), forward_runs(cfg))
            if runs and not again]
    return sum(t for t, _ in once), sum(f for _, f in once)


def fsdp2(cfg: Config, phi: float) -> Prediction:
    """torch_fsdp: ZeRO-3's three passes over Φ = phi (zero) less the backward all-gather of the root's trainable
    share of it (FSDP2 gathers the root once a step: fsdp2_backward_gathers) and the passes over the units forward
    never runs (without_never_run), with its frozen weights (fsdp2_frozen)."""
    p, n = zero(cfg, phi, 3, 3), cfg.backend.world_size
    if p.rounds:
        trains = sum(t for t, _ in unit_sizes(cfg)) or 1
        v = p.link.sent - (n - 1) / n * phi * fsdp2_forward_only(cfg)[0] / trains * BYTES[cfg.train.precision]
        p.nodes["worker"].link = LinkBytes(v, v)
    return fsdp2_frozen(without_never_run(p, cfg, phi), cfg)


def fsdp2_frozen(p: Prediction, cfg: Config) -> Prediction:
    """torch_fsdp's frozen weights: FSDP2's padded rows held; its all-gathers modelled as its trainable ones are
    (TorchFSDPTrainer's meter), (N - 1)/N of the frozen elements per pass: in forward those of the units it runs, in
    backward less those it gathers in forward only (fsdp2_forward_only)."""
    n, frozen = cfg.backend.world_size, sum(math.prod(s) for s in _frozen_shapes(cfg))
    ran = frozen - never_run(cfg)[1] if frozen else 0
    once = fsdp2_forward_only(cfg)[1] if frozen else 0
    return with_sharded_frozen(p, cfg, fsdp2_frozen_rows(cfg), (n - 1) / n * ran, (n - 1) / n * (ran - once))
