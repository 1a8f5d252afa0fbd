"""Units backward never reaches are not gathered for it. A unit whose forward output requires no grad (no parameter
that trains is used in it or upstream of it: LoRA on the last blocks only leaves the first ones so, and DLRM's
bottom MLP when only its tables train, though the tables are registered before it) has no backward: zero/stage3.py
gathers it once a step, in forward, and zero3_script says so; FSDP2 (torch's fully_shard) gathers it in backward
only where the unit after it prefetches it, and never gathers its root there (it keeps the root's parameters
gathered from forward through backward); fsdp_script and torch_fsdp's prediction say that, counted here on FSDP2's
own all-gathers (its set_custom_all_gather) at N = 2. A frozen unit after one that trains is reached and gathered
twice. theory.backward_reaches reads reach from a forward on the meta device, checked here against a real backward."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from parity import TINY_GPT, config
from psarch import registry
from psarch.config import from_dict
from psarch.model_units import find_units
from psarch.theory.program import DataStep
from psarch.workload import build_workload
from test_dlrm import TINY_DLRM
from zero.program import GATHER, fsdp_script
from zero.theory import backward_reaches, forward_order, fsdp2_backward_gathers, unit_sizes

GPT4 = {"gpt": {"n_layer": 4, "n_embd": 16, "n_head": 2}}
LATE_LORA = {"lora_rank": 2, "lora_alpha": 4.0, "lora_targets": ["blocks.2.*", "blocks.3.*"]}   # blocks 0, 1 frozen
MIDDLE = {"trainable": ["blocks.1.*", "head.weight"]}   # block 0 unreached; blocks 2, 3 frozen but reached


def _config(train: dict, backend: dict | None = None) -> Any:
    return from_dict(config("reach", TINY_GPT, workload=GPT4, train=train, backend=backend or {"kind": "single"}))


def fsdp2_gathers(rank: int, world_size: int, train: dict) -> dict:
    """The second step of torch_fsdp (TorchFSDPTrainer) on a 4-block GPT: the units FSDP2 all-gathers, in the order
    issued, the bytes those all-gathers send (N - 1 times each input shard: the ring's volume, a rank's own log of
    FSDP2's calls), and the all-gather bytes the trainer's meter books."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather   # FSDP2's own all-gather

    from psarch.dist import DistContext
    from zero.torch_peers import TorchFSDPTrainer

    log: list[str] = []
    sent = [0]

    class Counted(DefaultAllGather):   # FSDP2's own all-gather, its call and bytes written down
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, output_tensor, input_tensor, *args, **kwargs):
            log.append(self.name)
            sent[0] += (world_size - 1) * input_tensor.numel() * input_tensor.element_size()
            return super().__call__(output_tensor, input_tensor, *args, **kwargs)

    cfg = _config(train, {"kind": "torch_fsdp", "world_size": world_size})
    torch.manual_seed(0)
    work = build_workload(cfg)
    modules = [u.module or work.model for u in find_units(work.model, frozen_too=True)]
    trainer = TorchFSDPTrainer(work, cfg, DistContext(rank, world_size, rank, torch.device("cpu"), "gloo"))
    for i, module in enumerate(modules):
        module.set_custom_all_gather(Counted(str(i)))
    for step in range(2):
        log.clear()
        sent[0] = 0
        before = trainer.traffic().ops["all_gather"].sent if step else 0
        trainer.step(work.batch(step, rank, world_size))
    trainer.close()
    return {"units": log, "sent": sent[0], "metered": trainer.traffic().ops["all_gather"].sent - before}


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
@pytest.mark.parametrize("train, once", [(LATE_LORA, {"1"}), (MIDDLE, set()), ({}, set())],
                         ids=["late-lora", "middle", "all"])
def test_fsdp2_gathers_what_fsdp_script_and_the_prediction_say(train, once):
    """FSDP2 gathers the root once (kept), a block backward reaches twice, the block before the first it reaches
    twice too (prefetched, never used), the blocks before that once; fsdp_script issues the same, in the same order.
    The bytes its all-gathers send are what torch_fsdp's prediction counts beside its reduce-scatter, and what the
    trainer's meter books (a prediction that gathers the root twice is over by (N - 1)/N of the root's bytes)."""
    done = run_ranks(fsdp2_gathers, 2, train, timeout=300)[0]
    assert done["units"] == script_gathers(train)
    for unit in map(str, range(1, 5)):
        assert done["units"].count(unit) == (1 if unit in once else 2), (unit, done)
    assert done["units"].count("0") == 1
    cfg = _config(train, {"kind": "torch_fsdp", "world_size": 2})
    trains = sum(t for t, _ in unit_sizes(cfg))
    predicted = registry.spec_of(cfg).predict(cfg, trains).link.sent - 1 / 2 * 4 * trains   # less the reduce-scatter
    assert done["sent"] == pytest.approx(predicted, rel=1e-12)
    assert done["metered"] == done["sent"]


@pytest.mark.parametrize("train, again", [(LATE_LORA, [False, False, True, True, True]),
                                          (MIDDLE, [False] + [True] * 4), ({}, [False] + [True] * 4)])
def test_fsdp2_prediction_leaves_out_what_it_gathers_in_forward_only(train, again):
    """torch_fsdp's predicted all-gather bytes leave out, in backward, the root (kept gathered) and the frozen weights
    of the blocks FSDP2 leaves ungathered there, and only those: (N - 1)/N · 4 · (3T - T_root + 2F - F_once)."""
    cfg = _config(train, {"kind": "torch_fsdp", "world_size": 2})
    assert fsdp2_backward_gathers(cfg) == again
    sizes = unit_sizes(cfg)
    once = sum(f for (_, f), a in zip(sizes, again) if not a)
    frozen = sum(f for _, f in sizes)
    trains = sum(t for t, _ in sizes)
    p = registry.spec_of(cfg).predict(cfg, trains)
    assert p.link.sent == pytest.approx(1 / 2 * 4 * (3 * trains - sizes[0][0] + 2 * frozen - once), rel=1e-12)


def _dlrm(train: dict) -> Any:
    return from_dict(config("reach", TINY_DLRM, train=train, backend={"kind": "zero", "stage": 3, "world_size": 2}))


REACH_CASES = {
    "gpt, late lora": lambda: _config(LATE_LORA), "gpt, middle": lambda: _config(MIDDLE),
    "gpt, all": lambda: _config({}), "gpt, head only": lambda: _config({"trainable": ["head.weight"]}),
    "dlrm, tables only": lambda: _dlrm({"trainable": ["tables.*"]}),
    "dlrm, top only": lambda: _dlrm({"trainable": ["blocks.1.*"]}),
    "dlrm, bottom only": lambda: _dlrm({"trainable": ["blocks.0.*"]}),
    "dlrm, all": lambda: _dlrm({}),
}


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("case", list(REACH_CASES))
def test_backward_reaches_the_units_a_real_backward_reaches(case):
    """backward_reaches (a forward on the meta device) against a real CPU backward of the same small model: a block
    is reached where its backward runs (its full backward pre-hook fires), and a block that trains is reached exactly
    where its parameters get a .grad. DLRM registers its tables (the root) before its bottom MLP but runs them after
    it: with only the tables training, backward never reaches the bottom MLP. forward_order: the order the blocks'
    forwards end, the root last."""
    cfg = REACH_CASES[case]()
    work = build_workload(cfg)
    units = find_units(work.model, frozen_too=True)
    ran: list[int] = []
    ended: list[int] = []
    hooks = [u.module.register_full_backward_pre_hook(lambda m, g, i=i: ran.append(i))
             for i, u in enumerate(units) if i]
    hooks += [u.module.register_forward_hook(lambda m, a, o, i=i: ended.append(i)) for i, u in enumerate(units) if i]
    work.loss_fn(work.model, work.batch(0, 0, 2)).backward()
    for h in hooks:
        h.remove()
    real = [True] + [i in ran for i in range(1, len(units))]
    assert backward_reaches(cfg) == real, case
    for i, u in enumerate(units):
        if u.params:
            assert any(p.grad is not None for p in u.params) == real[i], (case, u.name)
    assert forward_order(cfg) == ended + [0]


def test_zero3_programs_take_the_units_in_forward_order(monkeypatch):
    """FSDP2 prefetches the unit after a unit in forward's order, and psarch's ZeRO-3 gathers by it too (zero/stage3.py,
    given theory.forward_order): both programs list the units in that order (the root first), not in the order they
    were registered in, where the two differ (a model whose forward runs its blocks in another order than it registers
    them), and leave out a unit forward never runs."""
    from zero import spec, theory
    cfg = _config({})
    sizes = theory.unit_sizes(cfg)
    assert len(sizes) >= 3
    assert spec._units(cfg)[0] == sizes   # the GPT runs its blocks as it registers them
    ran = list(reversed(range(2, len(sizes))))   # the blocks' forwards in the reverse of their registration, 1 unrun
    monkeypatch.setattr(theory, "forward_order", lambda c: ran + [0])
    assert spec._units(cfg)[0] == [sizes[0]] + [sizes[i] for i in ran]
