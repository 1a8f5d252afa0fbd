"""A compression's own work paced on the virtual device (psarch/cluster/work_pacing.py): each piece waits for what
the prediction prices it at (collective/compression_theory.py's compression_work at the device's rates) x D, where
it is done; without a virtual device nothing is paced. One rank, no process group: the work, not the wire."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from collective.comm import Communicator, Handle
from collective.compression import PowerSGD, TopK
from collective.compression_theory import compression_work
from psarch.cluster.device import as_paced, rates
from psarch.cluster.flops import count
from psarch.cluster.pacing import VirtualDevice
from psarch.cluster.stragglers import pacer
from psarch.cluster.work_pacing import WorkClock
from psarch.config import from_dict
from psarch.ps.theory import compressing_bytes
from psarch.ps.worker.topk import TopKPushes
from psarch.theory import cluster_step
from psarch.workload import build_workload

SHAPES = [torch.Size([64, 32]), torch.Size([32])]   # a weight PowerSGD factors at rank 4, a bias it sends whole
D = 3.0


class Alone(Communicator):
    """One rank and no process group: every collective leaves its tensor as it is."""

    def __init__(self) -> None:   # no torch.distributed: Communicator's own __init__ asks the group
        self.rank, self.world_size = 0, 1

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        return Handle(lambda: None) if async_op else None

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        output.copy_(input)
        return Handle(lambda: None) if async_op else None

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        output.copy_(input)
        return Handle(lambda: None) if async_op else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Handle | None:
        return Handle(lambda: None) if async_op else None

    def barrier(self) -> None:
        pass


def _step(compression: PowerSGD | TopK) -> float:
    """One bucket averaged (launched, then finished); its wall seconds."""
    grad = torch.randn(sum(s.numel() for s in SHAPES), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    compression.launch(0, grad, SHAPES)()
    compression.end_step()
    return time.perf_counter() - t0


@pytest.mark.parametrize("kind", ["powersgd", "topk"])
def test_a_compressed_bucket_waits_its_priced_work_times_d(kind):
    """The clock's account of a step is compression_work's FLOPs / FLOP rate (PowerSGD) or bytes / memory bandwidth
    (top-k), and the step took at least that x D of wall time; a tiny rate makes it 40 ms of cluster time, so an
    unpaced bucket (microseconds, nothing accounted) cannot pass."""
    ready, after = compression_work(kind, SHAPES, 4, ratio=0.1, rank=4)
    flops, nbytes = ready[0] + after[0], ready[1] + after[1]
    assert (flops > 0) == (kind == "powersgd") and (nbytes > 0) == (kind == "topk")
    clock = WorkClock(flops / 0.04, nbytes / 0.04, D)   # whichever the work is priced by: 40 ms a step
    compression = PowerSGD(Alone(), rank=4, warmup=0, seed=0) if kind == "powersgd" else TopK(Alone(), 0.1)
    compression.clock = clock
    for _ in range(2):   # the first step draws PowerSGD's Q, the second warm-starts from it: both paced alike
        clock.new_step()
        wall = _step(compression)
        assert clock.modelled_s == pytest.approx(0.04, rel=1e-9)
        assert wall >= 0.04 * D and clock.spent_s >= 0.04 * D * 0.999
        assert clock.host_s < wall   # the host's time was waited out, not added
    assert not clock.overran


def test_powersgd_warm_up_steps_and_no_clock_pace_nothing():
    """PowerSGD's warm-up steps all-reduce whole (no work priced, nothing factored); a PowerSGD handed no clock (no
    virtual device: the next test) does the work a clock would price, unpaced."""
    clock = WorkClock(1.0, 0.0, D)   # 1 FLOP/s: any priced work would take hours
    warming = PowerSGD(Alone(), rank=4, warmup=1, seed=0)
    warming.clock = clock
    assert _step(warming) < 1.0 and clock.modelled_s == 0.0 and warming.errors() == {}
    unpaced = PowerSGD(Alone(), rank=4, warmup=0, seed=0)
    assert _step(unpaced) < 1.0
    # it factored the bucket (the error feedback holds what rank 4 left out), work priced at > 0 FLOPs
    ready, after = compression_work("powersgd", SHAPES, 4, ratio=0.1, rank=4)
    assert unpaced.errors()[0].norm() > 0 and ready[0] + after[0] > 0


def test_the_runner_paces_only_on_a_virtual_device_at_the_predictions_rates():
    """A virtual device's pacer carries a WorkClock at psarch.cluster.device.rates (what prices the prediction's
    compression work) and D; without a modelled device there is no pacer, so no trainer is handed a clock."""
    base = {"backend": {"kind": "ddp", "world_size": 2}, "train": {"compression": "powersgd", "global_batch": 4},
            "workload": {"gpt": {"n_layer": 1, "n_embd": 16, "n_head": 2}}}
    plain = from_dict(base)
    assert pacer(plain, 0, build_workload(plain)) is None
    cfg = from_dict({**base, "cluster": {"device_tflops": 1e-6, "mfu": 0.5}})
    vd = pacer(cfg, 0, build_workload(cfg))
    assert isinstance(vd, VirtualDevice)
    assert (vd.work.flops_per_s, vd.work.memory_bytes_per_s, vd.work.dilation) == (*rates(cfg), 1.0)
    assert vd.work.flops_per_s == pytest.approx(0.5e6)
    vd.close()


def test_a_run_on_this_core_is_predicted_at_the_rate_its_ranks_were_paced_at():
    """The default emulated device (this core, measured at the run's start) leaves the launcher's config without a
    rate; the run's summary holds the one its ranks paced their compression work at. Predicted from the summary, the
    step prices that work as the same run with the rate given explicitly does, not at 0 (the rate unknown)."""
    base = {"backend": {"kind": "ddp", "world_size": 2}, "train": {"compression": "powersgd", "global_batch": 4},
            "workload": {"gpt": {"n_layer": 1, "n_embd": 64, "n_head": 2}}, "cluster": {"emulate": True}}
    asked = from_dict(base)
    explicit = from_dict({**base, "cluster": {"emulate": True, "device": "cpu-core", "device_tflops": 1e-4}})
    assert rates(asked)[0] == 0.0 and rates(explicit)[0] == pytest.approx(1e8)
    assert rates(as_paced(asked, {"peak_tflops": 1e-4}))[0] == pytest.approx(1e8)
    vd = {"peak_tflops": 1e-4, "compute_s": 0.05, "forward_s": 1.0, "backward_s": 2.0, "dilation": 4.0}
    summary = {"params": 10_000, "step_time_s": 0.1, "virtual_device": vd, "cluster": {"alpha_s": 4e-4}}
    paced, given = cluster_step(asked, summary)["predicted_s"], cluster_step(explicit, summary)["predicted_s"]
    unpriced = cluster_step(asked, {**summary, "virtual_device": {**vd, "peak_tflops": 0.0}})["predicted_s"]
    assert paced == pytest.approx(given) and paced > unpriced


def test_work_on_another_thread_does_not_move_the_models_deadlines():
    """Work in a future's callback (torch's hook, on a communication thread) is accounted but does not delay the
    model's paced compute; work on the clock's own thread (a bucket's hook in backward) does."""
    clock = WorkClock(1000.0, 0.0, 1.0)
    with clock.work(10.0):   # 10 ms here
        pass
    here = clock.spent_s

    def elsewhere() -> None:
        with clock.work(10.0):
            pass
    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert here >= 0.01 and clock.spent_s == here
    assert clock.modelled_s == pytest.approx(0.02)


def test_work_in_a_gradients_hook_delays_the_rest_of_backward():
    """Work in a post-accumulate hook (where a bucket's compression runs) moves backward's later deadlines: the
    backward takes its modelled time plus the work's, not the two overlapped, and the work is not its compute."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    loss_fn = lambda m, x: m(x).sum()   # noqa: E731
    flops = count(model, loss_fn, torch.randn(3, 8))
    clock = WorkClock(1000.0, 0.0, 1.0)
    vd = VirtualDevice(model, flops, (flops.forward + flops.backward) / 0.3, 1.0, lambda step: 1.0, clock)

    def compress(param: torch.Tensor) -> None:
        with clock.work(100.0):   # 0.1 s on the device, as the last layer's bucket leaves
            pass
    model[2].weight.register_post_accumulate_grad_hook(compress)
    loss = vd.wrap(loss_fn)(model, torch.randn(3, 8))
    t1 = time.perf_counter()
    loss.backward()
    took = time.perf_counter() - t1
    assert took >= vd.backward_s + 0.1 * 0.999
    assert vd.fields()["work_s"] == pytest.approx(0.1) and vd.bwd.host < vd.backward_s
    vd.close()


def test_a_ps_workers_top_k_push_waits_its_selections_bytes():
    """The PS worker's top-k selection is paced at psarch/ps/theory.py's compressing_bytes at the memory bandwidth."""
    cfg = from_dict({"train": {"compression": "topk"}, "backend": {"kind": "ps", "world_size": 2}})
    pushes = TopKPushes(0.1, lambda numel: compressing_bytes(cfg, numel))
    pushes.clock = clock = WorkClock(0.0, compressing_bytes(cfg, 1000) / 0.03, D)   # 30 ms for 1,000 elements
    t0 = time.perf_counter()
    keys, values = pushes.pairs(0, torch.randn(1000))
    assert time.perf_counter() - t0 >= 0.03 * D and len(keys) == 100
    assert clock.modelled_s == pytest.approx(0.03, rel=1e-9) and compressing_bytes(cfg, 1000) > 0
