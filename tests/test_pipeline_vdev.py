"""A pipeline on virtual devices: each stage's forward and backward of a micro-batch is paced by that call's own
FLOPs (psarch.cluster.call_pacing), not by the whole model's on the rank's whole batch; a call cut short at
its stage's output is paced, and so is its backward."""
from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch import nn

from dist_utils import run_ranks
from parity import config
from psarch.cluster.call_pacing import CallDevice
from psarch.cluster.flops import FlopCount, count
from psarch.config import ConfigError, from_dict
from psarch.dist import DistContext
from psarch.launch.runner import run_rank
from psarch.workload import build_workload
from timing import scaled

GPT = {"n_layer": 2, "n_embd": 32, "n_head": 2}
MODELLED_STEP_S = 0.12   # the whole model's forward + backward on the pipeline's batch, on the modelled device


def _data(rate: float = 1e9) -> dict:
    return config("pp-vd", workload={"gpt": GPT}, train={"steps": 5, "global_batch": 8},
                  backend={"kind": "pipeline", "world_size": 2, "stages": 2, "microbatches": 4, "schedule": "gpipe"},
                  cluster={"device_tflops": rate / 1e12, "mfu": 1.0})


def _rate() -> float:
    """The device rate at which the whole model's forward + backward on the global batch takes MODELLED_STEP_S."""
    cfg = from_dict(_data())
    w = build_workload(cfg)
    f = count(w.model, w.loss_fn, w.batch(0, 0, 1))
    return (f.forward + f.backward) / MODELLED_STEP_S


def _stage(rank: int, n: int, rate: float) -> dict:
    torch.set_num_threads(1)
    record = run_rank(from_dict(_data(rate)), DistContext(rank, n, rank, torch.device("cpu"), "gloo"), echo=False)
    steps = record.steps[1:]   # the first step counts each call's FLOPs
    compute = [s["extra"]["pipeline_s"] * (1 - s["extra"]["idle_fraction"]) for s in steps]
    return {"facts": record.virtual_device, "modelled": [s["modelled_s"] for s in steps], "compute": compute}


def test_each_stage_computes_its_share_of_the_flops_per_micro_batch():
    """Two stages, four micro-batches: the stages' modelled compute adds up to the whole model's step, each
    stage's real time in forward and backward is its own modelled time (without per-call pacing a stage was
    charged the whole model on its whole shard per call: the last stage 4x too long, the first barely paced)."""
    rate = _rate()
    stages = run_ranks(_stage, 2, rate, timeout=scaled(300))
    total = sum(s["facts"]["forward_s"] + s["facts"]["backward_s"] for s in stages)
    assert total == pytest.approx(MODELLED_STEP_S, rel=0.02)
    for rank, s in enumerate(stages):
        own = s["facts"]["forward_s"] + s["facts"]["backward_s"]
        assert 0.3 * MODELLED_STEP_S < own < 0.7 * MODELLED_STEP_S, (rank, own)   # about half the model each
        assert all(m == pytest.approx(own) for m in s["modelled"]), (rank, s["modelled"])
        took = statistics.median(s["compute"])
        assert own <= took < min(1 + scaled(0.3), 2.0) * own, (rank, took, own)   # by the load, far below 4x


class _Cut(Exception):
    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("cut")
        self.output = output


def test_a_call_cut_short_is_paced_and_so_is_its_backward():
    """A call that ends by an exception carrying its output waits out its forward's FLOPs, and the backward from
    that output waits out the forward's FLOPs x the whole model's backward/forward ratio."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    counter = torch.utils.flop_counter.FlopCounterMode(display=False)
    with counter:
        model(x)
    flops = counter.get_total_flops()
    rate = flops / 0.05                          # this call's forward: 50 ms modelled, its backward 100 ms
    dev = CallDevice(FlopCount(10, 20, (), ()), rate, 1.0, lambda step: 1.0)

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        raise _Cut(m(batch))

    paced = dev.wrap(loss_fn)
    dev.step = 0
    t0 = time.perf_counter()
    with pytest.raises(_Cut) as cut:
        paced(model, x)
    assert time.perf_counter() - t0 >= 0.05
    t0 = time.perf_counter()
    torch.autograd.backward(cut.value.output, torch.ones(32, 64))
    assert time.perf_counter() - t0 >= 0.10
    assert dev.calls == [flops]
    assert dev.fields()["modelled_s"] == pytest.approx(0.15)
    dev.step = 1                                 # the next step's first call: paced by the count, not recounted
    t0 = time.perf_counter()
    with pytest.raises(_Cut):
        paced(model, x)
    assert time.perf_counter() - t0 >= 0.05
    assert dev.calls == [flops] and dev.fields()["modelled_s"] == pytest.approx(0.05)


def test_torch_pipeline_refuses_a_virtual_device():
    data = _data()
    data["backend"]["kind"] = "torch_pipeline"
    with pytest.raises(ConfigError, match="cluster.device"):
        from_dict(data)
