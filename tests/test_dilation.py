"""cluster.dilation = "auto" (psarch/cluster/dilation.py): D from this machine's costs against the modelled ones,
α paid per message of the busiest process, the run's other processes stood in for while it measures, and a D
that covers a measured forward and backward."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from parity import config
from psarch.cluster import device, dilation
from psarch.cluster.dilation import AUTO_MARGIN, Costs, choose, resolve, round_up, spinning
from psarch.cluster.flops import count
from psarch.config import from_dict
from psarch.launch.ranks import run
from psarch.workload import build_workload


def test_auto_dilation_rule():
    """D = margin x the larger host/modelled ratio, rounded up; comm that runs during backward competes with
    compute."""
    assert [round_up(x) for x in (0.3, 1.0, 2.31, 23.01, 1040)] == [1.0, 1.0, 2.4, 24.0, 1100.0]
    costs = Costs(modelled_compute_s=0.01, modelled_comm_s=0.05, host_compute_s=0.03, host_comm_s=0.01,
                  overlapped=False)
    assert choose(costs) == round_up(AUTO_MARGIN * 3)
    overlapped = Costs(0.01, 0.05, 0.03, 0.01, overlapped=True)
    assert choose(overlapped) == round_up(AUTO_MARGIN * 4)
    comm_bound = Costs(0.01, 0.001, 0.001, 0.01, overlapped=False)
    assert choose(comm_bound) == round_up(AUTO_MARGIN * 10)


def test_auto_raises_d_until_the_host_adds_little():
    """serial_rule: the host's seconds beyond the prediction shrink D times; D is raised until they are at most
    HOST_SHARE of the predicted step, never lowered, and raised at most MAX_RAISE times."""
    from psarch.cluster.dilation import HOST_SHARE, MAX_RAISE, serial_rule
    assert serial_rule(0.0, 0.2, 3.0) == 3.0
    assert serial_rule(0.1, 0.2, 2.0) == round_up(0.1 / (HOST_SHARE * 0.2)) == 10.0
    assert serial_rule(0.001, 0.2, 2.0) == 2.0
    assert serial_rule(100.0, 0.2, 2.0) == MAX_RAISE * 2.0
    assert serial_rule(0.1, 0.0, 2.0) == 2.0


def test_calibration_runs_the_config_briefly_at_that_d(monkeypatch):
    """calibrate: the config itself, a few steps at the given D, without stragglers or jitter, into a folder it
    removes; the host's time is measured less predicted (cluster seconds) x D, none when it ran faster."""
    import psarch.theory
    seen = {}

    def fake_run(cfg, out, **kw):
        seen.update(cfg=cfg, out=out, kw=kw)
        return {"step_time_s": 0.3}
    monkeypatch.setattr(psarch.theory, "cluster_step", lambda cfg, s: {"measured_s": s["step_time_s"],
                                                                       "predicted_s": 0.25})
    cfg = from_dict(config("cal", backend={"kind": "ddp", "world_size": 2}, train={"steps": 50},
                           cluster={"emulate": True, "device": "v100", "slow_workers": [1], "slowdown": 4.0,
                                    "jitter": 0.2}))
    host_s, predicted_s = dilation.calibrate(cfg, 6.0, fake_run)
    assert host_s == pytest.approx(0.05 * 6.0) and predicted_s == 0.25
    probe = seen["cfg"]
    assert probe.cluster.dilation == 6.0 and probe.train.steps == dilation.CALIBRATION_STEPS
    assert probe.cluster.slow_workers == [] and probe.cluster.jitter == 0.0
    assert not seen["out"].parent.exists() and seen["kw"]["machine_checked"]
    monkeypatch.setattr(psarch.theory, "cluster_step", lambda cfg, s: {"measured_s": 0.2, "predicted_s": 0.25})
    assert dilation.calibrate(cfg, 6.0, fake_run) == (0.0, 0.25)


@pytest.mark.parametrize("backend, busiest", [
    ({"kind": "ps", "world_size": 4, "servers": 1}, "server"),
    ({"kind": "ps", "world_size": 4, "servers": 2}, "server"),
    ({"kind": "ps", "world_size": 4, "servers": 4}, "either"),
    ({"kind": "ps", "world_size": 4, "servers": 4, "server_placement": "colocated"}, "either"),
    ({"kind": "ddp", "world_size": 4, "bucket_cap_mb": 0.01}, "worker")])
def test_auto_pays_alpha_per_message_of_the_busiest_process(monkeypatch, backend, busiest):
    """measure's host communication: α once per message the busiest process handles in a step. A PS worker sends
    one request and takes one reply per partition per server; a server does so for every worker's share of its
    partitions (N/k times a worker's); a ring rank sends 2(N-1) messages per bucket."""
    monkeypatch.setattr(dilation, "loopback_alpha", lambda: 1.0)                 # 1 s a message: α dominates
    monkeypatch.setattr(dilation, "loopback_bytes_per_s", lambda nbytes: 1e15)
    monkeypatch.setattr(dilation, "_host_compute_s", lambda *a: 0.0)
    monkeypatch.setattr(dilation, "spinning", lambda n: contextlib.nullcontext())
    cfg = from_dict(config("alpha", backend={**backend, "partition_mb": 0.002} if backend["kind"] == "ps" else backend,
                           cluster={"emulate": True, "device": "v100", "link_mbps": 100.0}))
    wl = build_workload(cfg)
    phi = sum(p.numel() for p in wl.model.parameters())
    n, width = 4, 4
    if backend["kind"] == "ps":
        k = backend["servers"]
        parts = -(-(-(-phi // k)) // 512)   # partitions per server: 2 KiB of fp32 each, 512 elements
        assert parts > 1
        worker, server = 2 * parts * k, 2 * parts * n
    else:
        worker = 2 * (n - 1) * -(-phi * width // int(0.01 * 2**20))
        server = 0
    want = {"worker": worker, "server": server, "either": worker}[busiest]
    assert max(worker, server) == want
    assert dilation.measure(cfg).host_comm_s == pytest.approx(want, rel=1e-6)


def test_spinning_processes_take_cpu_and_go():
    """The run's other processes, stood in for while auto measures: they take CPU, and none is left after."""
    import os
    import subprocess
    before = set(subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True, text=True).stdout.split())
    t0 = time.process_time()
    with spinning(2):
        mine = set(subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "while True: pass"], capture_output=True,
                                  text=True).stdout.split())
        assert len(mine) == 2
        time.sleep(0.2)
    assert time.process_time() - t0 < 0.1          # the spinning was theirs, not this process's
    after = set(subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True, text=True).stdout.split())
    assert not (mine & after) and not (after - before)


def test_auto_covers_a_measured_compute():
    """resolve() on an emulated config picks D with D x modelled >= this machine's real forward+backward
    (timed here again, the fastest of five: the load of other work comes and goes between the two); without
    emulate, or without a device, D is 1; a number stays as given."""
    data = config("auto", backend={"kind": "ddp", "world_size": 2},
                  cluster={"emulate": True, "device": "v100"})
    cfg = from_dict(data)
    d = resolve(cfg, run, echo=False).cluster.dilation
    wl = build_workload(cfg)
    batch = wl.batch(0, 0, 2)
    c = count(wl.model, wl.loss_fn, batch)
    modelled = (c.forward + c.backward) / device.flops_per_s(cfg)
    torch.set_num_threads(1)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        wl.loss_fn(wl.model, batch).backward()
        times.append(time.perf_counter() - t0)
    assert d * modelled >= min(times), (d, modelled, times)
    assert cfg.cluster.dilation == "auto"                                          # cfg itself untouched
    assert resolve(from_dict(config("a", cluster={"device": "v100"})), run, echo=False).cluster.dilation == 1.0
    assert resolve(from_dict(config("a", cluster={"emulate": True})), run, echo=False).cluster.dilation == 1.0
    fixed = from_dict(config("a", cluster={"emulate": True, "device": "v100", "dilation": 7.0}))
    assert resolve(fixed, run, echo=False).cluster.dilation == 7.0
