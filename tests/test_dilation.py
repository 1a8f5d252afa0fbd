"""cluster.dilation = "auto" (psarch/cluster/dilation.py): D from this machine's costs against the modelled ones,
α paid per message of the busiest process, the run's other processes stood in for while it measures, a D
that covers a measured forward and backward and reads no predicted time; the emulated default device (this
machine's core, psarch/cluster/core.py); every timeout stretched by D; the line a run starts with."""
from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest
import torch

from cluster_setup import needs_root
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


@pytest.mark.parametrize("backend, busiest", [
    ({"kind": "ps", "world_size": 4, "servers": 1}, "server"),
    ({"kind": "ps", "world_size": 4, "servers": 2}, "server"),
    ({"kind": "ps", "world_size": 4, "servers": 4}, "either"),
    ({"kind": "ps", "world_size": 4, "servers": 4, "server_placement": "colocated"}, "node"),
    ({"kind": "ddp", "world_size": 4, "bucket_cap_mb": 0.01}, "worker")])
def test_auto_pays_alpha_per_message_of_the_busiest_process(monkeypatch, backend, busiest):
    """measure's host communication: the probe's cost per message once per message the busiest process handles in a
    step. A PS worker sends
    one request and takes one reply per partition per server; a server does so for every worker's share of its
    partitions (N/k times a worker's); a ring rank sends 2(N-1) messages per bucket and takes as many; a node with a
    worker and a server beside it handles both's messages but those between the two, which take no link (counted
    from the step's program: psarch.cluster.dilation.program_load)."""
    monkeypatch.setattr(dilation, "per_message_s", lambda probe, n: 1.0)        # 1 s a message: messages dominate
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
        worker = 2 * 2 * (n - 1) * -(-phi * width // int(0.01 * 2**20))
        server = 0
    node = worker + server - 2 * 2 * -(-(-(-phi // 4)) // 512)   # colocated: less a worker's with its own server
    want = {"worker": worker, "server": server, "either": worker, "node": node}[busiest]
    assert max(worker, server) == want or busiest == "node"
    assert dilation.measure(cfg).host_comm_s == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("backend, family", [
    ({"kind": "ps", "world_size": 4, "servers": 2, "partition_mb": 0.002}, "a parameter server's pushpull"),
    ({"kind": "ddp", "world_size": 4, "bucket_cap_mb": 0.01}, "a ring hop over gloo"),
    ({"kind": "zero", "stage": 1, "world_size": 4, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000},
     "a ring hop over gloo")])
def test_d_grows_with_the_probed_cost_per_message(monkeypatch, backend, family):
    """D comes from the backend's own probe of a message (BackendSpec.message_probe), asked with the run's workers
    and a server's partitions: a probe that says 1 us gives a small D, one that says 10 ms a D that covers the busiest
    process's messages at 10 ms each, x AUTO_MARGIN."""
    asked = []

    def probe(message_s):
        def measured(p, processes):
            asked.append((p, processes))
            return message_s
        return measured
    monkeypatch.setattr(dilation, "loopback_bytes_per_s", lambda nbytes: 1e15)
    monkeypatch.setattr(dilation, "_host_compute_s", lambda *a: 0.0)
    monkeypatch.setattr(dilation, "spinning", lambda n: contextlib.nullcontext())
    cfg = from_dict(config("probed", backend=backend, cluster={"emulate": True, "device": "v100", "link_mbps": 100.0}))
    k = dilation.modelled(cfg)
    monkeypatch.setattr(dilation, "per_message_s", probe(1e-6))
    small = resolve(cfg, echo=False).cluster.dilation
    monkeypatch.setattr(dilation, "per_message_s", probe(1e-2))
    large = resolve(cfg, echo=False).cluster.dilation
    assert k.load is not None and k.load.messages > 0
    host = 1e-2 * k.load.messages
    want = round_up(AUTO_MARGIN * max(host / k.compute_s if k.load.during else 0.0, host / k.link_s))
    assert large == want and large > 10 * small, (small, large, want)
    (p, processes), _ = asked
    assert p.family == family and processes == 4 + (2 if backend["kind"] == "ps" else 0)
    if backend["kind"] == "ps":   # 4 workers; a server's partitions of 512 elements (2 KiB of fp32)
        held = -(-(-(-k.phi // 2)) // 512)
        assert p.args == (4, held, cfg.train.optimizer)


def test_spinning_processes_take_cpu_and_go():
    """The run's other processes, stood in for while auto measures: they take CPU, and none is left after."""
    import os
    import subprocess
    def spinners() -> set[str]:   # this process's own (another run on the machine may be spinning its own)
        return set(subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "while True: pass"], capture_output=True,
                                  text=True).stdout.split())
    t0 = time.process_time()
    with spinning(2):
        mine = spinners()
        assert len(mine) == 2
        time.sleep(0.2)
    assert time.process_time() - t0 < 0.1          # the spinning was theirs, not this process's
    left = set(subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True, text=True).stdout.split())
    assert not spinners() and not (mine & left)


def test_auto_covers_a_measured_compute():
    """resolve() on an emulated config picks D with D x modelled >= this machine's real forward+backward
    (timed here again, the fastest of five: the load of other work comes and goes between the two); without
    emulate, or without a device, D is 1; a number stays as given."""
    data = config("auto", backend={"kind": "ddp", "world_size": 2},
                  cluster={"emulate": True, "device": "v100"})
    cfg = from_dict(data)
    d = resolve(cfg, echo=False).cluster.dilation
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
    assert resolve(from_dict(config("a", cluster={"device": "v100"})), echo=False).cluster.dilation == 1.0
    measured = from_dict(config("a", cluster={"emulate": True, "device": "cpu-measured"}))
    assert resolve(measured, echo=False).cluster.dilation == 1.0
    fixed = from_dict(config("a", cluster={"emulate": True, "device": "v100", "dilation": 7.0}))
    assert resolve(fixed, echo=False).cluster.dilation == 7.0


@pytest.mark.parametrize("backend", [{"kind": "ps", "world_size": 4, "servers": 2, "partition_mb": 0.002},
                                     {"kind": "ddp", "world_size": 4, "bucket_cap_mb": 0.01}])
def test_d_reads_no_predicted_time(monkeypatch, backend):
    """"auto" picks D from probes of this machine alone: no predicted step or communication time is read (each
    raises here), and the run itself is not tried."""
    import psarch.theory

    def consulted(*a, **k):
        raise AssertionError("dilation consulted the prediction")
    for f in ("cluster_step", "simulated_step"):
        monkeypatch.setattr(psarch.theory, f, consulted)
    monkeypatch.setattr("psarch.launch.ranks.run", consulted)
    monkeypatch.setattr(dilation, "spinning", lambda n: contextlib.nullcontext())   # the probes, unhurried
    for cluster in ({"emulate": True, "device": "v100", "link_mbps": 100.0}, {"emulate": True, "link_mbps": 100.0}):
        got = resolve(from_dict(config("probe", backend=backend, cluster=cluster)), echo=False)
        assert isinstance(got.cluster.dilation, float) and got.cluster.dilation >= 1.0


def test_default_emulated_device_is_this_core_measured_alone():
    """On an emulated cluster with no device set, every worker stands for this machine's core: the run's model
    timed on one thread, its rate recorded for the ranks as cpu-core's, mfu not applied; on loopback the default
    computes as this machine does (no device model); cpu-measured stays by name."""
    from psarch.cluster import core
    cfg = from_dict(config("core", backend={"kind": "ddp", "world_size": 2}, cluster={"emulate": True}))
    assert device.chosen(cfg) == device.CORE and device.modelled(cfg)
    got = resolve(cfg, echo=False)
    c = got.cluster
    assert c.device == "cpu-core" and c.device_tflops > 0 and device.flops_per_s(got) == c.device_tflops * 1e12
    assert cfg.cluster.device == "auto" and cfg.cluster.device_tflops == 0    # cfg itself untouched
    # the rate is FLOPs / seconds of the same forward and backward, as the pacing counts them
    wl = build_workload(cfg)
    batch = wl.batch(0, 0, 2)
    flops = count(wl.model, wl.loss_fn, batch)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    wl.loss_fn(wl.model, batch).backward()
    assert c.device_tflops * 1e12 > 0.2 * (flops.forward + flops.backward) / (time.perf_counter() - t0)
    assert 0 < core.flops_per_s(cfg) < 1e13
    given = resolve(from_dict(config("g", cluster={"emulate": True, "device": "cpu-core", "device_tflops": 0.002,
                                                   "dilation": 3.0})), echo=False)
    assert device.flops_per_s(given) == pytest.approx(2e9)       # a given rate, not measured; mfu not applied
    loopback = from_dict(config("l"))
    assert device.chosen(loopback) == device.MEASURED and not device.modelled(loopback)
    named = from_dict(config("m", cluster={"emulate": True, "device": "cpu-measured"}))
    assert not device.modelled(named)


def test_this_core_is_timed_in_the_runs_compute_dtype(monkeypatch):
    """cpu-core's rate is measured on the model as the trainers run it: in bf16 the probe's forward and backward
    see bf16 weights (a CPU's bf16 is not its fp32), in fp32 fp32 ones."""
    from psarch.cluster import core
    from psarch import workload as wl_module
    seen: list[torch.dtype] = []
    real = wl_module.build_workload

    def recording(cfg):
        wl = real(cfg)
        loss_fn = wl.loss_fn

        def timed(model, batch):
            seen.append(next(model.parameters()).dtype)
            return loss_fn(model, batch)
        return dataclasses.replace(wl, loss_fn=timed)
    monkeypatch.setattr(wl_module, "build_workload", recording)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        seen.clear()
        cfg = from_dict(config("p", backend={"kind": "ddp", "world_size": 2}, cluster={"emulate": True},
                               train={"precision": precision}))
        assert core.flops_per_s(cfg) > 0
        assert seen and set(seen) == {dtype}, (precision, seen)


def test_every_timeout_is_stretched_by_d():
    """The ranks' and services' config: every backend timeout x D (backend.timeout_s, the PS's heartbeat, handshake
    and resend timeouts); at D = 1 none."""
    cfg = from_dict(config("w", backend={"kind": "ps", "world_size": 2, "timeout_s": 3.0, "resend_timeout_s": 1.5},
                           cluster={"emulate": True, "device": "v100", "dilation": 20.0}))
    got = resolve(cfg, echo=False)
    b = got.backend
    assert (b.timeout_s, b.heartbeat_timeout_s, b.handshake_timeout_s, b.resend_timeout_s) == \
        (60.0, 20 * cfg.backend.heartbeat_timeout_s, 20 * cfg.backend.handshake_timeout_s, 30.0)
    assert b.heartbeat_s == cfg.backend.heartbeat_s                     # an interval, not a wait
    loopback = resolve(from_dict(config("l", backend={"kind": "ps", "world_size": 2, "timeout_s": 3.0})), echo=False)
    assert loopback.backend.timeout_s == 3.0


def test_the_first_line_says_device_d_why_and_wall_time(capsys):
    """An emulated run starts with one line: the device each worker stands for, D and why, the estimated wall
    time; past an hour, a line more says so before anything starts."""
    cfg = from_dict(config("say", backend={"kind": "ddp", "world_size": 2}, train={"steps": 10},
                           cluster={"emulate": True, "device": "v100", "dilation": 4.0, "link_mbps": 100.0}))
    got = resolve(cfg, echo=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("psarch: each worker stands for device v100 at 6.28 TFLOP/s; D = 4: as given; "
                               "estimated wall time ")
    k = dilation.modelled(got)
    assert k.model_s == pytest.approx(2 * 4 * sum(x.numel() for x in k.workload.model.parameters()) * 8 / 100e6)
    assert f"{4 * (10 * (k.compute_s + k.link_s) + k.model_s):.0f} s (10 steps and the model in and out)" in lines[0]
    long = from_dict(config("long", backend={"kind": "ddp", "world_size": 2}, train={"steps": 10},
                            cluster={"emulate": True, "device": "v100", "dilation": 4.0, "link_mbps": 0.001}))
    resolve(long, echo=True)
    lines = capsys.readouterr().out.splitlines()
    one = dataclasses.replace(k, compute_s=1.0, link_s=0.0, model_s=2.0)
    assert dilation.wall_s(long, one) == 4 * (10 + 2)
    slow = dataclasses.replace(long, cluster=dataclasses.replace(long.cluster, slow_workers=[1], slowdown=4.0))
    assert dilation.wall_s(slow, one) == 4 * (40 + 2)           # the straggler sets every step
    assert len(lines) == 2 and "over an hour of wall time" in lines[1], lines
    resolve(from_dict(config("core", cluster={"emulate": True, "dilation": 5.0})), echo=True)
    assert "each worker stands for this machine's core alone, measured at " in capsys.readouterr().out


@needs_root
def test_a_dilated_ps_run_outlasts_its_own_timeout(tmp_path):
    """A PS at D = 10 on an emulated cluster, a 4x straggler: worker 0's pull waits 3 x 50 ms of modelled compute
    x D = 1.5 s of wall clock a step for worker 1's push, past backend.timeout_s = 1 s (the server's deadline on
    the round, as written). Stretched by D with every other timeout, the run completes; a server whose
    deadline stayed 1 s of host time refused the round (checked once by hand at D = 20: "no gradients from
    worker(s) [1] within backend.timeout_s = 1 s"). D = 10, not 20: each step's wait is still past the timeout,
    in half the wall time."""
    data = config("d10", workload={"factory": "factories:regression"}, train={"steps": 3, "global_batch": 4},
                  backend={"kind": "ps", "world_size": 2, "servers": 1, "timeout_s": 1.0},
                  cluster={"emulate": True, "link_mbps": 100.0, "device_tflops": 1.0, "mfu": 1.0, "dilation": 10.0,
                           "slow_workers": [1], "slowdown": 4.0})
    wl = build_workload(from_dict(data))
    f = count(wl.model, wl.loss_fn, wl.batch(0, 0, 2))
    data["cluster"]["device_tflops"] = (f.forward + f.backward) / 0.05 / 1e12   # 50 ms a step
    summary = run(from_dict(data), tmp_path / "run", echo=False)
    assert summary["virtual_device"]["dilation"] == 10.0 and summary["cluster"]["dilation"] == 10.0
    assert summary["step_time_s"] >= 4 * 0.05                    # the straggler's step, in the cluster's time


@pytest.mark.parametrize("backend, during", [({"kind": "ddp", "bucket_cap_mb": 0.01}, True),
                                             ({"kind": "ddp", "bucket_cap_mb": 0.01, "overlap_comm": False}, False),
                                             ({"kind": "ddp"}, False),
                                             ({"kind": "zero", "stage": 3}, True),
                                             ({"kind": "ps", "servers": 2, "partition_mb": 0.002}, True),
                                             ({"kind": "ps", "servers": 2, "mode": "geo"}, False)])
def test_communication_during_compute_is_read_from_the_program(backend, during):
    """Whether a step's communication competes with its compute for the cores: buckets or partitions sent from
    backward's hooks, ZeRO-3's passes between its units' compute; not one bucket ready at backward's end, not
    buckets sent after backward, not GEO's exchange after its local steps. And the busiest link's bytes, the
    prediction's."""
    from psarch.theory import predict

    cfg = from_dict(config("load", backend={"world_size": 4, **backend}))
    phi = sum(p.numel() for p in build_workload(cfg).model.parameters())
    load = dilation.program_load(cfg, phi, 0.05)
    assert load is not None and load.during is during and load.messages > 0
    # the busiest link and direction: a rank's, or a dedicated server's (all workers' pushes in), per step; the
    # prediction's server is the mean one, the program's busiest holds a partition (512 elements) more
    p = predict(cfg, phi)
    server = p.nodes.get("server")
    links = [p.link.sent, p.link.received] + ([server.link.sent, server.link.received] if server else [])
    assert max(links) * (1 - 1e-3) <= load.link_bytes <= max(links) + (4 * 4 * 512 if server else 0) + 1e-6
    assert load.server_link is (server is not None)
