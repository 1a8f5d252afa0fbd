"""Units backward never reaches are not gathered for it. A unit whose forward output requires no grad (it trains
nothing, nor does anything before it: LoRA on the last blocks only leaves the first ones so) has no backward:
zero/stage3.py gathers it once a step, in forward, and zero3_script says so; FSDP2 (torch's fully_shard) gathers it
in backward only where the unit after it prefetches it, and fsdp_script says that, counted here on FSDP2's own
all-gathers (its set_custom_all_gather) at N = 2. A frozen unit after one that trains is reached and gathered twice."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from parity import TINY_GPT, config
from psarch.config import from_dict
from psarch.model_units import find_units
from psarch.theory.program import DataStep
from psarch.workload import build_workload
from zero.program import GATHER, fsdp_script
from zero.spec import TORCH_FSDP
from zero.theory import backward_reaches, fsdp2_unreached, unit_sizes

GPT4 = {"gpt": {"n_layer": 4, "n_embd": 16, "n_head": 2}}
LATE_LORA = {"lora_rank": 2, "lora_alpha": 4.0, "lora_targets": ["blocks.2.*", "blocks.3.*"]}   # blocks 0, 1 frozen
MIDDLE = {"trainable": ["blocks.1.*", "head.weight"]}   # block 0 unreached; blocks 2, 3 frozen but reached


def _config(train: dict, backend: dict | None = None) -> Any:
    return from_dict(config("reach", TINY_GPT, workload=GPT4, train=train, backend=backend or {"kind": "single"}))


def fsdp2_gathers(rank: int, world_size: int, train: dict) -> list[str]:
    """The units FSDP2 all-gathers in the second step of a 4-block GPT, in the order issued (a rank's own log)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    from torch.distributed.device_mesh import init_device_mesh

    log: list[str] = []

    class Counted(DefaultAllGather):   # FSDP2's own all-gather, its call written down
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, *args, **kwargs):
            log.append(self.name)
            return super().__call__(*args, **kwargs)

    torch.manual_seed(0)
    work = build_workload(_config(train))
    mesh = init_device_mesh("cpu", (world_size,))
    units = find_units(work.model, frozen_too=True)
    for i, u in enumerate(units[1:], 1):
        fully_shard(u.module, mesh=mesh)
        u.module.set_custom_all_gather(Counted(str(i)))
    fully_shard(work.model, mesh=mesh)
    work.model.set_custom_all_gather(Counted("0"))
    for step in range(2):
        log.clear()
        work.loss_fn(work.model, work.batch(step, rank, world_size)).backward()
    return log


def script_gathers(train: dict) -> list[str]:
    """The units fsdp_script all-gathers (FSDP2's prefetch of one, its root kept), in the order issued: a unit's
    trainable and frozen parameters, two collectives in the script, are one in FSDP2's mixed group."""
    cfg = _config(train, {"kind": "torch_fsdp", "world_size": 2})
    sizes, reached = unit_sizes(cfg), backward_reaches(cfg)
    script = fsdp_script([float(t) for t, _ in sizes], DataStep.of(1.0), prefetch=1, keep_first=True,
                         frozen=[float(f) for _, f in sizes], reached=reached)
    issued = [(a.name[0], a.name.lstrip("fbag").rstrip("f")) for a in script if a.kind == GATHER]
    return [unit for _, unit in dict.fromkeys(issued)]


@pytest.mark.slow
@pytest.mark.parametrize("train, once", [(LATE_LORA, {"1"}), (MIDDLE, set())], ids=["late-lora", "middle"])
def test_fsdp2_gathers_what_fsdp_script_says(train, once):
    """FSDP2 gathers the root once (kept), a block backward reaches twice, the block before the first it reaches
    twice too (prefetched, never used), the blocks before that once; fsdp_script issues the same, in the same order."""
    done = run_ranks(fsdp2_gathers, 2, train, timeout=300)[0]
    assert done == script_gathers(train)
    for unit in map(str, range(1, 5)):
        assert done.count(unit) == (1 if unit in once else 2), (unit, done)
    assert done.count("0") == 1


@pytest.mark.parametrize("train, unreached", [(LATE_LORA, [False, True, False, False, False]),
                                              (MIDDLE, [False] * 5), ({}, [False] * 5)])
def test_fsdp2_prediction_leaves_out_the_unreached_frozen_bytes(train, unreached):
    """torch_fsdp's predicted all-gather bytes drop the frozen weights of the blocks FSDP2 leaves ungathered in
    backward, and only those: (N - 1)/N · 4 · (2F - F_unreached) beside the trainable passes."""
    cfg = _config(train, {"kind": "torch_fsdp", "world_size": 2})
    assert fsdp2_unreached(cfg) == unreached
    sizes = unit_sizes(cfg)
    skipped = sum(f for (_, f), u in zip(sizes, unreached) if u)
    frozen = sum(f for _, f in sizes)
    trains = sum(t for t, _ in sizes)
    p = TORCH_FSDP.predict(cfg, trains)
    assert p.link.sent == pytest.approx(1 / 2 * 4 * (3 * trains + 2 * frozen - skipped), rel=1e-12)
