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
from zero.program import COMPUTE, GATHER, WAIT, zero3_script
from zero.stage12 import MAX_IN_FLIGHT
from zero.stage3 import Stage3


class Recorder:
    """A communicator of rank 0 of 2 that does nothing but log each collective, and each wait on one, by unit."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.engine: Stage3 | None = None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        pass

    def _handle(self, what: tuple[str, int]) -> Handle:
        return Handle(lambda: self.log.append(("wait", *map(str, what))), poll=lambda: False)

    def all_gather(self, full: torch.Tensor, chunk: torch.Tensor, async_op: bool = False) -> Handle | None:
        assert self.engine is not None
        i = next(j for j, f in enumerate(self.engine.full) if f is full)
        self.log.append(("gather", str(i)))
        return self._handle(("gather", i))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        assert self.engine is not None
        i = next(j for j, g in self.engine._grads.items() if g is input)
        self.log.append(("reduce", str(i)))
        if not async_op:   # a blocking call returns once the collective is done
            self.log.append(("wait", "reduce", str(i)))
        return self._handle(("reduce", i)) if async_op else None


def trainer_order(prefetch: str, overlap: bool) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """What Stage3 asked of its communicator in one step of a 3-block GPT, and what zero3_script says it asks."""
    cfg = from_dict(config("z3", TINY_GPT, workload={"gpt": {"n_layer": 3, "n_embd": 16, "n_head": 2}},
                           backend={"kind": "zero", "stage": 3, "world_size": 2}))
    torch.manual_seed(0)
    work = build_workload(cfg)
    units = find_units(work.model)
    comm = Recorder()
    engine = comm.engine = Stage3(work.model, units, comm, 0, overlap)   # type: ignore[arg-type]
    sizes = [float(g.padded) for g in engine.part.groups]
    engine.prefetch_numel = {"none": 0, "one": int(sizes[1]), "all": int(sum(sizes))}[prefetch]
    comm.log.clear()
    engine.begin_step()
    work.loss_fn(work.model, work.batch(0, 0, 1)).backward()
    engine.reduce_gradients()
    assert not engine.pinned, "the tiny GPT reads no parameter outside forward: the schedule modelled"
    script = zero3_script(sizes, DataStep.of(1.0), engine.prefetch_numel, overlap, MAX_IN_FLIGHT)
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
