"""Virtual devices and time dilation: FLOPs as torch counts them, a step that takes max(real, modelled x D),
the cluster's times (wall / D) and link rates (link / D), overrun steps counted and reported, stragglers on
modelled time, and the config's rules (auto's D: test_dilation.py)."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from cluster_setup import needs_root
from parity import assert_same_model, config, model
from psarch.cluster import device
from psarch.cluster.flops import FlopCount, count
from psarch.cluster.pacing import VirtualDevice
from psarch.cluster.stragglers import pacer
from psarch.config import ConfigError, allowed_values, from_dict
from psarch.launch.ranks import run
from psarch.records import RankRecord
from psarch.workload import build_workload
from timing import scaled


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _sum_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def test_flops_are_flop_counter_modes():
    """Forward and backward apart, equal to FlopCounterMode's own count of the same model (and to the matmuls
    by hand: 2·3·8·16 + 2·3·16·4 forward; backward without the first layer's input gradient)."""
    model, x = _mlp(), torch.randn(3, 8)
    with FlopCounterMode(display=False) as fwd:
        loss = _sum_loss(model, x)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    c = count(_mlp(), _sum_loss, x)
    assert (c.forward, c.backward) == (fwd.get_total_flops(), bwd.get_total_flops()) == (1152, 1536)
    # where they fall: layer 2 starts after layer 1's 768 FLOPs; its gradients are ready after its 768 of backward
    assert c.module_marks == (0.0, 0.0, 768 / 1152, 768 / 1152)
    assert c.param_marks == (1.0, 1.0, 0.5, 0.5)


def test_a_loss_that_reads_values_is_counted_on_a_real_copy():
    """.item() cannot run on the meta device: counted on a copy of the real model, which stays untouched,
    and the random state is as it was."""
    def reads(model, x):
        loss = model(x).sum()
        return loss * 0 + loss if loss.item() == loss.item() else loss
    model, x = _mlp(), torch.randn(3, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    assert count(model, reads, x).forward == 1152
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model[0].weight.grad is None


def _device(real_s: float, forward_s: float, backward_s: float, dilation: float = 1.0, factor: float = 1.0):
    """A VirtualDevice on one linear layer whose forward takes `real_s` for real, modelled at forward_s +
    backward_s (cluster time); returns (device, paced loss function, its model)."""
    model = nn.Linear(4, 1)
    flops = FlopCount(1000, 2000, (0.0,), (1.0, 1.0))
    vd = VirtualDevice(model, flops, 1000 / forward_s, dilation, lambda step: factor)
    vd.backward_s = backward_s

    def loss_fn(m, x):
        time.sleep(real_s)
        return m(x).sum()
    return vd, vd.wrap(loss_fn), model


def _timed_step(loss_fn, model) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = loss_fn(model, torch.ones(2, 4))
    t1 = time.perf_counter()
    loss.backward()
    return t1 - t0, time.perf_counter() - t1


@pytest.mark.parametrize("real_s, dilation", [(0.01, 1.0), (0.01, 2.0), (0.12, 1.0)])
def test_a_step_takes_max_of_real_and_modelled_times_dilation(real_s, dilation):
    """Forward modelled at 40 ms, backward at 60 ms: each takes max(real, modelled x D), within 25 ms; a
    forward whose real 120 ms overran its 40 ms is counted, the others are not."""
    vd, loss_fn, model = _device(real_s, 0.04, 0.06, dilation)
    fwd, bwd = _timed_step(loss_fn, model)
    late = min(scaled(0.025), 0.035)   # by the load, below the 40 ms a sum (120 + 40) would add over the max
    assert max(real_s, 0.04 * dilation) <= fwd < max(real_s, 0.04 * dilation) + late
    assert 0.06 * dilation <= bwd < 0.06 * dilation + late
    assert vd.overrun == (real_s > 0.04 * dilation)
    f = vd.fields()
    assert f["modelled_s"] == pytest.approx(0.1) and f["overrun"] == vd.overrun
    assert real_s / dilation <= f["host_s"] < (real_s + late) / dilation   # the real compute, cluster time


def test_a_straggler_multiplies_the_modelled_time():
    """Factor 3 (a slow worker): 3 x the modelled times, as if its device were 3 x slower."""
    vd, loss_fn, model = _device(0.0, 0.02, 0.03, factor=3.0)
    fwd, bwd = _timed_step(loss_fn, model)
    late = min(scaled(0.025), 0.035)   # by the load, well below the 40 ms and 60 ms of a factor 1 higher
    assert 0.06 <= fwd < 0.06 + late and 0.09 <= bwd < 0.09 + late
    assert vd.fields()["modelled_s"] == pytest.approx(0.15)


def test_pacer_draws_each_workers_factor_from_the_config():
    """slow_workers' slowdown and jitter multiply the modelled time; jitter may make a step faster."""
    data = config("vd", backend={"kind": "ddp", "world_size": 2},
                  cluster={"device_tflops": 1.0, "slow_workers": [1], "slowdown": 4.0, "jitter": 0.3})
    cfg = from_dict(data)
    fast, slow = (pacer(cfg, r, build_workload(cfg)) for r in (0, 1))
    assert isinstance(fast, VirtualDevice) and fast.forward_s == pytest.approx(fast.flops.forward / 0.4e12)
    ratios = [slow.factor(s) / fast.factor(s) for s in range(20)]
    assert min(fast.factor(s) for s in range(20)) < 1 < max(fast.factor(s) for s in range(20))
    assert 0.3 < min(ratios) and max(ratios) / min(ratios) > 1.5   # each worker its own draws
    assert pacer(from_dict(config("plain")), 0, build_workload(from_dict(config("plain")))) is None


def test_the_runner_reports_cluster_time(tmp_path):
    """D = 3 (emulate set, no placement: run_rank alone): a step of 60 ms modelled takes >= 180 ms of wall
    clock, and its record says ~60 ms, not 180."""
    from psarch.dist import DistContext
    from psarch.launch.runner import run_rank
    data = config("dil", workload={"factory": "factories:regression"}, train={"steps": 3, "global_batch": 4},
                  cluster={"emulate": True, "device_tflops": 1.0, "mfu": 1.0, "dilation": 3.0})
    cfg = from_dict(data)
    wl_flops = pacer(cfg, 0, build_workload(cfg)).flops
    rate = (wl_flops.forward + wl_flops.backward) / 0.06   # modelled compute: 60 ms a step
    cfg.cluster.device_tflops = rate / 1e12
    t0 = time.perf_counter()
    record = run_rank(cfg, DistContext(), echo=False)
    assert time.perf_counter() - t0 >= 3 * 3 * 0.06
    for s in record.steps:
        assert s["modelled_s"] == pytest.approx(0.06)
        # / 3: the cluster's time; a step the loaded host made late (late_s, also cluster time) is that much longer
        assert 0.06 <= s["step_time_s"] < 0.06 + s["late_s"] + 0.03, s
    assert record.virtual_device["dilation"] == 3.0


def test_link_rates_are_the_clusters_over_d():
    cfg = from_dict({"backend": {"kind": "ps", "world_size": 2, "servers": 1},
                     "cluster": {"emulate": True, "device": "h100", "dilation": 40.0, "link_mbps": 100000.0,
                                 "server_link_mbps": 400000.0}})
    assert device.dilation(cfg) == 40.0 and device.shaped_mbps(cfg) == (2500.0, 10000.0)
    loopback = from_dict({"cluster": {"device": "h100"}})
    assert device.dilation(loopback) == 1.0 and device.shaped_mbps(loopback) == (1000.0, 1000.0)
    assert device.flops_per_s(cfg) == pytest.approx(67e12 * 0.4)


def _records(overruns: list[list[bool]]) -> list[RankRecord]:
    facts = {"forward_flops": 10, "backward_flops": 20, "forward_s": 0.01, "backward_s": 0.02, "dilation": 5.0}
    return [RankRecord(r, [{"step": s, "modelled_s": 0.03 * (1 + r), "overrun": o} for s, o in enumerate(steps)],
                       {}, {}, {}, "cpu", None, None, 1, "w", virtual_device=facts) for r, steps in enumerate(overruns)]


def test_overrun_steps_are_counted_and_reported():
    """Counted over the timed steps: in lockstep, a step in which any worker overran (every worker waits for it);
    at their own pace, each worker's steps. More than 5% of them: one line in summary.json and at the end of
    report.txt."""
    cfg = from_dict(config("o", cluster={"device": "a100"}, backend={"kind": "ddp", "world_size": 2}))
    few = device.summary(cfg, _records([[False] * 20, [True] + [False] * 19]), set(range(20)))
    assert few["overrun_steps"] == 1 and few["counted_steps"] == 20 and few["warning"] is None   # 5%: not over
    assert few["compute_s"] == pytest.approx(0.06)   # the slowest worker's modelled compute
    both = device.summary(cfg, _records([[True] + [False] * 19, [True, True] + [False] * 18]), set(range(20)))
    assert both["overrun_steps"] == 2 and both["overrun_of"] == "steps"   # step 0 overran once, for both
    many = device.summary(cfg, _records([[True] * 3 + [False] * 17, [False] * 20]), set(range(20)))
    assert many["overrun_steps"] == 3 and many["overrun_fraction"] == 0.15
    assert "3 of 20 timed steps (15%) overran" in many["warning"]
    own = from_dict(config("o", cluster={"device": "a100"}, backend={"kind": "ps", "mode": "async", "world_size": 2}))
    apart = device.summary(own, _records([[True] * 3 + [False] * 17, [False] * 20]), set(range(20)))
    assert apart["overrun_fraction"] == 0.075 and "3 of 40 timed worker-steps (8%) overran" in apart["warning"]
    warm = device.summary(cfg, _records([[True] * 3 + [False] * 17, [False] * 20]), set(range(3, 20)))
    assert warm["overrun_steps"] == 0                # warm-up steps are not counted
    lines = device.report_lines(many, alpha_s=2e-5)
    assert lines[-1] == many["warning"] and "4 us of cluster time" in lines[1]
    assert device.summary(from_dict(config("m")), _records([[True]]), {0}) is None   # cpu-measured: none


def test_theory_uses_the_modelled_compute():
    """With a virtual device, cluster_step's compute is the modelled one (not the measured step less its
    wait), α is the host's / D and backward hides what it models (the step simulator's step of its program)."""
    from psarch.theory import cluster_step, simulated_step
    cfg = from_dict(config("t", backend={"kind": "ddp", "world_size": 4, "bucket_cap_mb": 0.01},
                           cluster={"emulate": True, "device": "a100", "dilation": 10.0, "link_mbps": 100.0}))
    vd = {"compute_s": 0.03, "forward_s": 0.029, "backward_s": 0.001, "dilation": 10.0}
    summary = {"params": 10_000, "step_time_s": 0.5, "comm_s": 0.1, "extra": {},
               "cluster": {"alpha_s": 1e-4}, "virtual_device": vd}
    got = cluster_step(cfg, summary)
    want = simulated_step(cfg, 10_000, 0.03, 0.001, 1e-5).step_s
    assert got["compute_s"] == 0.03 and got["predicted_s"] == pytest.approx(want)
    assert want != pytest.approx(simulated_step(cfg, 10_000, 0.03, None, 1e-5).step_s)   # backward's share counts
    del summary["virtual_device"]
    assert cluster_step(cfg, summary)["compute_s"] == pytest.approx(0.4)   # measured: step less wait


@pytest.mark.parametrize("cluster, message", [
    ({"device": "k80"}, 'cluster.device = "k80": allowed values are "auto", "cpu-core", "cpu-measured", "h100", "h200", '
                           '"a100", "v100"'),
    ({"device": "h100", "mfu": 0.0}, "cluster.mfu = 0.0: must be in (0, 1]"),
    ({"device": "h100", "mfu": 1.5}, "cluster.mfu = 1.5: must be <= 1"),
    ({"device": "h100", "emulate": True, "dilation": 0.5}, "cluster.dilation = 0.5: must be >= 1"),
    ({"device": "h100", "dilation": "fast"}, 'cluster.dilation = "fast": expected a number or "auto"'),
    ({"emulate": True, "device": "cpu-measured", "dilation": 4}, "cluster.dilation = 4.0: needs a modelled device"),
    ({"dilation": 4}, "cluster.dilation = 4.0: needs a modelled device"),   # "auto" on loopback: cpu-measured
    ({"device": "h100", "dilation": 4}, "cluster.dilation = 4.0: needs cluster.emulate = true"),
    ({"device": "h100", "device_tflops": 3.0}, "cluster.device_tflops = 3: a custom device replaces a profile"),
])
def test_config_errors_in_one_line(cluster, message):
    with pytest.raises(ConfigError) as e:
        from_dict(config("bad", cluster=cluster))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_v100_has_no_bf16_and_keys_show_auto():
    with pytest.raises(ConfigError, match='cluster.device = "v100": has no bf16 peak'):
        from_dict(config("bad", cluster={"device": "v100"}, train={"precision": "bf16"}))
    assert allowed_values("cluster.dilation") == 'number >= 1 | "auto"'
    assert from_dict(config("ok", cluster={"device": "v100", "dilation": "auto"})).cluster.dilation == "auto"


def test_hooks_fire_where_the_modelled_time_is():
    """A post-accumulate hook (where DDP and ZeRO launch a bucket) on the last layer's weight fires when half
    the modelled backward has passed, its share of the backward's FLOPs, not at once nor at the end; a
    forward pre-hook registered after the device's (as ZeRO-3's gather) fires at its module's modelled start."""
    model = _mlp()
    flops = count(model, _sum_loss, torch.randn(3, 8))
    vd = VirtualDevice(model, flops, (flops.forward + flops.backward) / 0.3, 1.0, lambda step: 1.0)
    fired: dict[str, float] = {}

    def at(what: str):
        return lambda *args: fired.setdefault(what, time.perf_counter()) and None
    model[2].weight.register_post_accumulate_grad_hook(at("bucket"))
    model[2].register_forward_pre_hook(at("gather"))
    loss_fn = vd.wrap(_sum_loss)
    t0 = time.perf_counter()
    loss = loss_fn(model, torch.randn(3, 8))
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    fwd, bwd = vd.forward_s, vd.backward_s            # 0.3 s in all, split as the FLOPs are
    assert fired["gather"] - t0 == pytest.approx(fwd * 768 / 1152, abs=0.02)
    assert fired["bucket"] - t1 == pytest.approx(bwd * 0.5, abs=0.02)
    assert t2 - t1 == pytest.approx(bwd, abs=0.02)


@needs_root
def test_an_emulated_run_of_virtual_devices(tmp_path):
    """Ring DDP on 2 emulated nodes of a 0.01-TFLOPS device at D = 2: the same model as `single` (the device
    changes time, never results), links shaped at link_mbps / 2, times the cluster's, the device reported."""
    reference = run(from_dict(config("ref", backend={"kind": "single"})), tmp_path / "ref", echo=False)
    cluster = {"emulate": True, "link_mbps": 400.0, "device_tflops": 0.01, "mfu": 0.5, "dilation": 2.0}
    s = run(from_dict(config("vd", backend={"kind": "ddp", "world_size": 2, "bucket_cap_mb": 0.001},
                             cluster=cluster)), tmp_path / "vd", echo=False)
    assert_same_model(model(tmp_path / "vd", "model"), model(tmp_path / "ref", "model"), "virtual device")
    vd = s["virtual_device"]
    assert vd["dilation"] == 2.0 and reference["steps"] == s["steps"]
    assert vd["counted_steps"] == s["steps"] - 1 and vd["overrun_of"] == "steps"   # lockstep: each step once
    assert all(n["link_mbps"] == 200.0 for n in s["cluster"]["nodes"])
    assert s["step_time_s"] >= vd["compute_s"] and s["cluster"]["step_time"]["compute_s"] == vd["compute_s"]
    assert "time dilation   D = 2" in (tmp_path / "vd" / "report.txt").read_text()
    from psarch.report.cluster import rows, table
    (row,) = rows(tmp_path)
    assert row["dilation"] == 2.0 and row["compute"] == vd["compute_s"] and "compute (modelled)" in table([row])
    assert row["wall"] == s["cluster"]["wall_s"] > s["steps"] * s["step_time_s"] * 2   # the whole run, at D = 2
    assert table([row]).splitlines()[0].endswith(" D | overrun steps | wall |")
    assert table([row]).splitlines()[2].endswith(f" {row['wall']:.0f} s |")


def test_the_last_bucket_waits_for_the_end_of_the_modelled_backward():
    """The first layer's gradients are ready when the real backward ends: their bucket (a post-accumulate
    hook) must not leave before the modelled backward does, or one bucket's communication would hide
    inside the wait at the end."""
    model = _mlp()
    flops = count(model, _sum_loss, torch.randn(3, 8))
    vd = VirtualDevice(model, flops, (flops.forward + flops.backward) / 0.15, 1.0, lambda step: 1.0)
    fired: list[float] = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: fired.append(time.perf_counter()) and None)
    loss = vd.wrap(_sum_loss)(model, torch.randn(3, 8))
    t1 = time.perf_counter()
    loss.backward()
    assert fired[0] - t1 >= vd.backward_s * 0.95


def test_straggler_table_shows_the_lockstep_prediction_d_and_overruns():
    from psarch.report.stragglers import table
    row = {"mode": "ps sync", "slowdown": 4.0, "jitter": 0.0, "samples_per_s": 270.4, "predicted": 281.0,
           "target_gap": 0.25, "time_to_gap": None, "final_gap": 0.08, "dilation": 30.0, "overrun": 0.021}
    async_row = dict(row, mode="ps async", predicted=None, dilation=None, overrun=None)
    lines = table([row, async_row], 0.25).splitlines()
    assert lines[2] == "| ps sync | 4x | 0 | 270 | 281 | not reached | 0.080 | 30 | 2% |"
    assert lines[3] == "| ps async | 4x | 0 | 270 |  | not reached | 0.080 |  |  |"


def test_a_device_the_host_cannot_keep_up_with_is_said_so_last(tmp_path, monkeypatch):
    """A device of 10^6 TFLOPS on loopback (D = 1): every step's real compute overruns its nanoseconds of
    modelled time; summary.json and the last line of report.txt say so, and the FLOPs were counted once for
    the run's 6 steps, not once a step."""
    from psarch.cluster import stragglers
    calls = []

    def counted(*args):
        calls.append(1)
        return count(*args)
    monkeypatch.setattr(stragglers, "count", counted)
    cfg = from_dict(config("fast", workload={"factory": "factories:regression"}, backend={"kind": "single"},
                           train={"steps": 6, "global_batch": 4}, cluster={"device_tflops": 1e6}))
    s = run(cfg, tmp_path / "fast", echo=False)
    vd = s["virtual_device"]
    assert len(calls) == 1
    assert vd["overrun_steps"] == vd["counted_steps"] == s["steps"] - 1 and vd["dilation"] == 1.0
    assert vd["warning"].startswith(f"virtual device: {vd['counted_steps']} of {vd['counted_steps']} timed")
    assert (tmp_path / "fast" / "report.txt").read_text().splitlines()[-1] == vd["warning"]
