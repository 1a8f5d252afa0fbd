"""A finite loss with inf/nan gradients stops the run, for every backend, naming the step and the rank (and the
parameters where the backend keeps gradients on them), and leaves no poisoned model.pt behind: the optimizer
refuses the update (MixedPrecisionOptimizer's one fused check, the torch peers' step_if_finite) and the
runner's guard, the one that checks the loss, stops the run."""
from __future__ import annotations

import itertools
import json
import re

import pytest

from parity import TINY_GPT, config, train
from psarch.launch import supervise
from psarch.config import from_dict
from psarch.errors import NON_FINITE_EXIT, NonFiniteGradient
from psarch.launch.ranks import RunError, run
from psarch.precision import MixedPrecisionOptimizer
from psarch.launch.spawn import run_ranks
from timing import scaled

STEPS = 4
BACKENDS = {
    "single": {"kind": "single", "world_size": 1},
    "ddp-ring": {"kind": "ddp", "world_size": 2, "comm": "ring"},
    "ddp-native": {"kind": "ddp", "world_size": 2, "comm": "native"},
    "zero1": {"kind": "zero", "world_size": 2, "stage": 1},
    "zero2": {"kind": "zero", "world_size": 2, "stage": 2},
    "zero3": {"kind": "zero", "world_size": 2, "stage": 3},
    "torch_zero": {"kind": "torch_zero", "world_size": 2},
    "torch_fsdp": {"kind": "torch_fsdp", "world_size": 2},
}
NAMED = ("single", "ddp-ring", "ddp-native")   # gradients kept on the model's parameters: always named


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_nan_gradient_with_a_finite_loss_stops_the_run(backend, tmp_path):
    cfg = from_dict({"name": "nan-grad", "workload": {"factory": "finite_factories:nan_grad_on_last_shard_at_last_step"},
                     "train": {"steps": STEPS, "global_batch": 8, "optimizer": "sgd", "lr": 0.05, "log_every": 100},
                     "backend": dict(BACKENDS[backend], timeout_s=30.0)})
    named = r" \(of net\.0\.weight, net\.0\.bias, net\.2\.weight, \.\.\.\)" if backend in NAMED else r"(?: \(of .*\))?"
    with pytest.raises(RunError, match=rf"step {STEPS - 1}: rank \d's gradients{named} hold "
                                       r"inf/nan while its loss \([0-9.e+-]+\) is finite"):
        run(cfg, tmp_path, echo=False)
    assert not (tmp_path / "model.pt").exists()


def _poisoned(rank: int, n: int, data: dict, out: str) -> str:
    """Train `data` with every rank's gradients turned NaN as the optimizer takes them at the last step (the
    psarch backends' MixedPrecisionOptimizer, the torch peer's step_if_finite); the error the run stopped with."""
    import collective.tensor.torch_peer as peer

    calls = itertools.count()

    def poison(grads) -> None:
        if next(calls) == STEPS - 1:
            grads[0].view(-1)[0] = float("nan")

    def poisoned(step):
        return lambda opt, grads, *args: (poison(grads), step(opt, grads, *args))[1]

    # in this spawned rank only
    MixedPrecisionOptimizer.step = poisoned(MixedPrecisionOptimizer.step)
    peer.step_if_finite = poisoned(peer.step_if_finite)
    try:
        train(rank, n, data, {}, out)
    except NonFiniteGradient as e:
        return str(e)
    return "finished"


@pytest.mark.parametrize("backend", [{"kind": "pipeline", "stages": 2}, {"kind": "tensor", "comm": "ring"},
                                     {"kind": "torch_tensor"}], ids=["pipeline", "tensor", "torch_tensor"])
def test_pipeline_and_tensor_refuse_a_nan_gradient(backend, tmp_path):
    # their specs refuse factories: the NaN is put into the gradients the optimizer is handed
    data = config("poisoned", TINY_GPT, train={"steps": STEPS, "optimizer": "sgd", "lr": 0.1},
                  workload=dict(TINY_GPT["workload"], gpt={"n_layer": 2, "n_embd": 16, "n_head": 2}),
                  backend=dict(backend, world_size=2))
    errors = run_ranks(_poisoned, 2, data, str(tmp_path), timeout=scaled(120))
    for rank, e in enumerate(errors):
        assert re.match(rf"step {STEPS - 1}: rank {rank}'s gradients(?: \(of .*\))? hold inf/nan while its loss", e), e
    assert not (tmp_path / "poisoned.pt").exists()


def test_a_peers_nan_loss_is_named_before_the_gradients_it_spread(tmp_path):
    # ddp: worker 1's NaN loss reaches worker 0 as refused gradients, possibly recorded first
    (tmp_path / "ranks").mkdir()
    for rank, error, at in [(0, "NonFiniteGradient: step 3: rank 0's gradients hold inf/nan", 100),
                            (1, "NonFiniteError: step 3: worker 1's loss is nan", 200)]:
        (tmp_path / "ranks" / f"rank{rank}.error").write_text(json.dumps(
            {"rank": rank, "error": error, "failed_at_ns": at, "traceback": ""}))
    assert supervise.root_cause(tmp_path, {0: NON_FINITE_EXIT, 1: NON_FINITE_EXIT}) == 1
