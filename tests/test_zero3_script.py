"""ZeRO-3's step program follows its trainer: zero/program.py's zero3_script issues and waits for the all-gathers
and reduce-scatters in the order zero/stage3.py's Stage3 does, unit by unit, recorded from a real forward and
backward of a tiny GPT on a communicator that only writes down what it is asked (no processes)."""
from __future__ import annotations

import pytest
import torch

from collective.comm import Handle
from parity import TINY_GPT, config
from psarch.config import from_dict
from psarch.model_units import find_units
from psarch.theory.program import DataStep
from psarch.workload import build_workload
from test_zero3_backward_reach import LATE_LORA, MIDDLE
from zero.program import COMPUTE, GATHER, WAIT, zero3_script
from zero.stage12 import MAX_IN_FLIGHT
from zero.stage3 import Stage3
from zero.theory import backward_reaches


class Recorder:
    """A communicator of rank 0 of 2 that does nothing but log each collective, and each wait on one, by unit."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.engine: Stage3 | None = None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        pass

    def _handle(self, what: tuple[str, int | str]) -> Handle:
        return Handle(lambda: self.log.append(("wait", *map(str, what))), poll=lambda: False)

    def all_gather(self, full: torch.Tensor, chunk: torch.Tensor, async_op: bool = False) -> Handle | None:
        assert self.engine is not None
        names = {id(f): str(j) for j, f in enumerate(self.engine.full)}
        names.update((id(f), f"{j}f") for j, f in self.engine.frozen.full.items())   # a unit's frozen weights
        self.log.append(("gather", names[id(full)]))
        return self._handle(("gather", names[id(full)]))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        assert self.engine is not None
        i = next(j for j, g in self.engine._grads.items() if g is input)
        self.log.append(("reduce", str(i)))
        if not async_op:   # a blocking call returns once the collective is done
            self.log.append(("wait", "reduce", str(i)))
        return self._handle(("reduce", i)) if async_op else None


def trainer_order(prefetch: str, overlap: bool, train: dict | None = None,
                  n_layer: int = 3) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """What Stage3 asked of its communicator in one step of a GPT of n_layer blocks (`train`: its frozen weights, as
    the trainer finds its units then), and what zero3_script says it asks, with theory's units reached by backward."""
    cfg = from_dict(config("z3", TINY_GPT, workload={"gpt": {"n_layer": n_layer, "n_embd": 16, "n_head": 2}},
                           backend={"kind": "zero", "stage": 3, "world_size": 2}, train=train or {}))
    torch.manual_seed(0)
    work = build_workload(cfg)
    units = find_units(work.model, frozen_too=True)
    comm = Recorder()
    engine = comm.engine = Stage3(work.model, units, comm, 0, overlap)   # type: ignore[arg-type]
    sizes = [float(g.padded) if g.numel else 0.0 for g in engine.part.groups]
    frozen = [float(engine.frozen.numel(i)) for i in range(len(units))]
    whole = int(sum(sizes) + sum(frozen))
    engine.prefetch_numel = {"none": 0, "one": int(sizes[-1] + frozen[-1]), "all": whole}[prefetch]
    for step in range(2):   # the second step: nothing left from the first
        comm.log.clear()
        engine.begin_step()
        work.loss_fn(work.model, work.batch(step, 0, 1)).backward()
        engine.reduce_gradients()
    assert not engine.pinned, "the tiny GPT reads no parameter outside forward: the schedule modelled"
    script = zero3_script(sizes, DataStep.of(1.0), engine.prefetch_numel, overlap, MAX_IN_FLIGHT, frozen,
                          reached=backward_reaches(cfg))
    issued = {a.name: ("gather" if a.kind == GATHER else "reduce", a.name.lstrip("fbagrs")) for a in script
              if a.kind not in (WAIT, COMPUTE)}
    said = [("wait", *issued[a.name]) if a.kind == WAIT else issued[a.name] for a in script if a.kind != COMPUTE]
    return comm.log, said


@pytest.mark.parametrize("prefetch", ["none", "one", "all"])
@pytest.mark.parametrize("overlap", [True, False])
def test_zero3_script_is_the_order_stage3_issues_and_waits_in(prefetch, overlap):
    done, said = trainer_order(prefetch, overlap)
    assert sum(1 for x in done if x[0] == "gather") == 2 * 4 and sum(1 for x in done if x[0] == "reduce") == 4
    assert said == done


@pytest.mark.parametrize("prefetch", ["none", "one", "all"])
@pytest.mark.parametrize("train, unreached", [(LATE_LORA, {"1", "2"}), (MIDDLE, {"1"})], ids=["late-lora", "middle"])
def test_units_backward_never_reaches_are_gathered_once(prefetch, train, unreached):
    """A 4-block GPT whose leading blocks train nothing: Stage3 gathers those in forward only, every other unit
    (frozen ones after a block that trains included) in forward and backward, and zero3_script says the same."""
    done, said = trainer_order(prefetch, True, train, n_layer=4)
    gathers = [x[1] for x in done if x[0] == "gather"]   # "3": unit 3's trainable parameters, "3f": its frozen ones
    assert {x.rstrip("f") for x in gathers} == set(map(str, range(5)))
    for x in set(gathers):
        assert gathers.count(x) == (1 if x.rstrip("f") in unreached else 2), (x, gathers)
    assert said == done
