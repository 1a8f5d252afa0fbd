"""ZeRO-3 takes its units in the order forward runs them, and leaves out a unit forward never runs. tests/factories.py's
ShuffledBlocks registers blocks 0-3 and runs 2, 0, 1: block 3 never. zero.theory.forward_order (one forward on the
meta device) is the order zero/stage3.py gathers, prefetches and reduce-scatters by (recorded here without processes)
and the order zero3_script says; FSDP2 (torch's fully_shard, whose all-gathers and reduce-scatters are counted here
with its set_custom_all_gather / set_custom_reduce_scatter at N = 2) never gathers nor reduces block 3 either, and
fsdp_script says what it issues. Bytes counted = bytes predicted (no parameter is padded at N = 2), and psarch's
ZeRO-3 ends with the model single and FSDP2 end with."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from parity import OPTIMIZERS, assert_same_model, config
from psarch import registry
from psarch.config import from_dict
from psarch.model_units import find_units
from psarch.theory.program import DataStep
from psarch.workload import build_workload
from test_zero3_script import Recorder
from zero.program import COMPUTE, GATHER, REDUCE, WAIT, fsdp_script, zero3_script
from zero.stage12 import MAX_IN_FLIGHT
from psarch.errors import ConfigError
from zero.stage3 import Stage3
from zero.theory import backward_reaches, forward_order, forward_runs, never_run, unit_sizes

ZERO3 = {"kind": "zero", "stage": 3, "world_size": 2}
FSDP2 = {"kind": "torch_fsdp", "world_size": 2}
RAN = [0, 3, 1, 2]   # the root, then blocks.2, blocks.0, blocks.1 (units 3, 1, 2); blocks.3 (unit 4) never runs


def _config(backend: dict) -> Any:
    return from_dict(config("order", workload={"factory": "factories:shuffled_blocks"}, backend=backend,
                            train=OPTIMIZERS["adamw"]))


def _predicted(cfg: Any) -> float:
    """The bytes a rank sends in a step, as the backend's prediction says: all-gathers and reduce-scatters."""
    return registry.spec_of(cfg).predict(cfg, sum(t for t, _ in unit_sizes(cfg))).link.sent


def test_theory_reads_the_order_forward_runs_the_blocks_in():
    cfg = _config(ZERO3)
    assert forward_order(cfg) == RAN[1:] + [0]
    assert forward_runs(cfg) == [True, True, True, True, False]
    assert never_run(cfg) == (unit_sizes(cfg)[4][0], 0) and unit_sizes(cfg)[4][0] > 0
    assert backward_reaches(cfg) == [True, True, True, True, False]


def test_a_factory_whose_loss_cannot_run_for_the_order_is_one_clear_error():
    cfg = from_dict(config("order", workload={"factory": "factories:loss_only_in_training"}, backend=ZERO3))
    with pytest.raises(ConfigError, match=r"workload.factory = \"factories:loss_only_in_training\": its loss did not run "
                                          r"once .*RuntimeError: this loss runs only in training$"):
        forward_order(cfg)


class Counting(Recorder):
    """Recorder, adding up what rank 0 of 2 sends: an all-gather's chunk, a reduce-scatter's chunk (N - 1 = 1 each)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def all_gather(self, full: torch.Tensor, chunk: torch.Tensor, async_op: bool = False) -> Any:
        self.sent += chunk.numel() * chunk.element_size()
        return super().all_gather(full, chunk, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
        self.sent += output.numel() * output.element_size()
        return super().reduce_scatter(output, input, async_op)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("prefetch", ["none", "one", "all"])
@pytest.mark.parametrize("overlap", [True, False])
def test_stage3_issues_in_forward_order_what_zero3_script_says(prefetch, overlap):
    """Stage3, given theory's order, gathers the root, then blocks.2, blocks.0, blocks.1 (prefetching in that order),
    backward in its reverse, and never gathers or reduces blocks.3; zero3_script over the units in that order (the
    ZeRO spec's own list) asks the same, in the same order; the bytes sent are the prediction's."""
    from zero.spec import _units

    cfg = _config(ZERO3)
    torch.manual_seed(0)
    work = build_workload(cfg)
    comm = Counting()
    engine = comm.engine = Stage3(work.model, find_units(work.model, frozen_too=True), comm, 0, overlap,
                                  order=forward_order(cfg))   # type: ignore[arg-type]
    sizes = [float(engine.part.groups[i].padded) for i in RAN]
    assert sizes == [float(t) for t, _ in _units(cfg)[0]]   # the spec's units: these, in this order
    engine.prefetch_numel = {"none": 0, "one": int(sizes[1]), "all": int(sum(sizes))}[prefetch]
    for step in range(2):   # the second step: nothing left from the first
        comm.log.clear()
        comm.sent = 0
        engine.begin_step()
        work.loss_fn(work.model, work.batch(step, 0, 1)).backward()
        engine.reduce_gradients()
    script = zero3_script(sizes, DataStep.of(1.0), engine.prefetch_numel, overlap, MAX_IN_FLIGHT,
                          reached=_units(cfg)[1])
    issued = {a.name: ("gather" if a.kind == GATHER else "reduce", str(RAN[int(a.name.lstrip("fbagrs"))]))
              for a in script if a.kind not in (WAIT, COMPUTE)}
    said = [("wait", *issued[a.name]) if a.kind == WAIT else issued[a.name] for a in script if a.kind != COMPUTE]
    assert said == comm.log
    gathers = [x[1] for x in comm.log if x[0] == "gather"]
    assert gathers[:4] == list(map(str, RAN)) and "4" not in gathers and ("reduce", "4") not in comm.log
    assert comm.sent == pytest.approx(_predicted(cfg), rel=1e-12)


def _train(rank: int, world_size: int, backend: dict, steps: int) -> dict:
    """`steps` steps of a backend on ShuffledBlocks: on FSDP2 the units its all-gathers and reduce-scatters move in
    the last step, in the order issued (its own collectives, counted); the bytes the trainer's meter books in the
    last step; rank 0's final model."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    from psarch.dist import DistContext
    from psarch.trainer import load_trainer

    log: list[tuple[str, str]] = []
    sent = [0]

    class Gather(DefaultAllGather):
        def __init__(self, unit: str) -> None:
            self.unit = unit

        def __call__(self, output_tensor, input_tensor, *args, **kwargs):
            log.append(("gather", self.unit))
            sent[0] += (world_size - 1) * input_tensor.numel() * input_tensor.element_size()
            return super().__call__(output_tensor, input_tensor, *args, **kwargs)

    class Reduce(DefaultReduceScatter):
        def __init__(self, unit: str) -> None:
            self.unit = unit

        def __call__(self, output_tensor, input_tensor, *args, **kwargs):
            log.append(("reduce", self.unit))
            sent[0] += (world_size - 1) * output_tensor.numel() * output_tensor.element_size()
            return super().__call__(output_tensor, input_tensor, *args, **kwargs)

    cfg = _config(backend)
    work = build_workload(cfg)
    trainer = load_trainer(backend["kind"])(work, cfg, DistContext(rank, world_size, rank, torch.device("cpu"),
                                                                  "gloo" if world_size > 1 else None))
    if backend["kind"] == "torch_fsdp":
        for i, u in enumerate(find_units(work.model, frozen_too=True)):
            module = u.module or work.model
            module.set_custom_all_gather(Gather(str(i)))
            module.set_custom_reduce_scatter(Reduce(str(i)))
    for step in range(steps):
        log.clear()
        sent[0] = 0
        before = trainer.traffic().sent
        trainer.step(work.batch(step, rank, world_size))
    metered = trainer.traffic().sent - before
    model = {k: v.tolist() for k, v in trainer.full_state_dict().items()}   # the ranks answer in JSON
    trainer.close()
    return {"log": [list(x) for x in log], "sent": sent[0], "metered": metered, "model": model}


def _model(run: dict) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v) for k, v in run["model"].items()}


def test_fsdp2_and_zero3_leave_out_the_block_forward_never_runs():
    """FSDP2 gathers the root (kept through backward), then blocks.2, blocks.0, blocks.1; in backward it gathers
    those again in reverse and reduce-scatters each, the root last; blocks.3 never: fsdp_script over the spec's
    units says the same, and its bytes (all-gathers and reduce-scatters) are torch_fsdp's prediction and its meter's.
    psarch's ZeRO-3 sends what its prediction says; both end where single does (AdamW; but FSDP2's blocks.3, which
    no gradient reaches: torch's AdamW skips a parameter without one, where single's and ZeRO-3's flat buffers give
    it a zero gradient and decay it)."""
    from zero.spec import _units

    steps = 3
    fsdp = run_ranks(_train, 2, FSDP2, steps, timeout=300)[0]
    zero = run_ranks(_train, 2, ZERO3, steps, timeout=300)[0]
    single = _train(0, 1, {"kind": "single"}, steps)
    cfg = _config(FSDP2)
    sizes, reached = _units(cfg)
    script = fsdp_script([float(t) for t, _ in sizes], DataStep.of(1.0), prefetch=1, keep_first=True, reached=reached)
    said = [("gather" if a.kind == GATHER else "reduce", str(RAN[int(a.name.lstrip("fbagrs"))]))
            for a in script if a.kind in (GATHER, REDUCE)]
    assert [tuple(x) for x in fsdp["log"]] == said
    assert not any(unit == "4" for _, unit in fsdp["log"])
    assert fsdp["sent"] == pytest.approx(_predicted(cfg), rel=1e-12)
    assert fsdp["metered"] == fsdp["sent"]
    assert zero["metered"] == pytest.approx(_predicted(_config(ZERO3)), rel=1e-12)
    assert_same_model(_model(zero), _model(single), "zero-3 vs single")
    ran = {k: v for k, v in _model(single).items() if not k.startswith("blocks.3.")}
    assert_same_model({k: _model(fsdp)[k] for k in ran}, ran, "fsdp2 vs single")
