"""cluster.dilation = "auto": the D an emulated cluster of virtual devices runs at, picked once, in the
launcher, before any rank starts (every rank and every link must use the same D).

D must stretch the cluster's times past what this machine spends on them, with margin. Both are measured
here, while `processes - 1` helper processes spin on the CPU in place of the run's other ranks and servers
(all computing at once, as a synchronous step starts): the contention the run itself will bring, beside
whatever else the machine is running now.
- compute: a worker's real forward and backward must fit inside the modelled compute x D;
- communication: the host's own cost of the step's messages (α of a TCP ping-pong and bytes/s of one
  stream on this machine's loopback; α paid once per message the busiest process handles: a worker's every
  bucket, or a server's every worker's partitions, `messages`) must fit inside their time on the cluster's
  links x D; where the backend communicates during backward (BackendSpec.comm_model: overlap with several
  buckets, or passes inside compute), that cost competes with the compute for the same cores, and counts on
  its side too.
D = AUTO_MARGIN x the larger of the two ratios, at least 1, rounded up to two significant digits.
AUTO_MARGIN is 2 for the load that comes and goes after the measurement.

Those two are estimates: a ping-pong's α and one stream's bytes/s are far below what a ring hop or a partition
costs when every rank of the run takes its turn on the same cores (at 1 Gbit/s the ring at N = 4 got too small a D
from them and ran far over its prediction). So a short run of the config itself at that D follows
(`calibrate`): what it took beyond its prediction is this machine's time, spent in sequence with the links, the
same wall-clock seconds at any D, so D times fewer of the cluster's; D is raised until that is at most
HOST_SHARE of the step (`serial_rule`).

What no D stretches: TCP's own timers (delayed ACKs, the 200 ms minimum retransmission timeout) and the
host's per-message latency α, which are the same wall-clock times at every D, so D times shorter in the
cluster's time than on the host. The emulated cluster's α is α / D (reported beside the results).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from psarch import registry
from psarch.cluster import device
from psarch.cluster.alpha import loopback_alpha, loopback_bytes_per_s
from psarch.cluster.flops import count
from psarch.records import Summary

AUTO_MARGIN = 2.0
# Then a short run at that D: what this machine adds to the step beyond the prediction, it adds in sequence with
# the links (a ring hop's turn on a loaded core, a partition's trip through the kernel), the same wall-clock
# seconds at every D, so D times fewer of the cluster's. D is raised until that is at most HOST_SHARE of the
# step, by at most MAX_RAISE (a prediction that is wrong would otherwise raise it without end).
CALIBRATION_STEPS = 4
HOST_SHARE = 0.05
MAX_RAISE = 10.0
# The loopback's bytes/s is measured on a stream of the step's payload, within these bounds: at least 8 MiB,
# so one delayed wake-up of the receiving thread does not pass for a slow stream.
MIN_PROBE_BYTES, MAX_PROBE_BYTES = 8 * 2**20, 32 * 2**20

if TYPE_CHECKING:
    from psarch.config import Config
Runner = Callable[..., Summary]   # launch.ranks.run: (cfg, out, echo=, machine_checked=, progress=) -> summary


@dataclass(frozen=True)
class Costs:
    """A step of one worker: modelled on the cluster (cluster time) and spent by this machine (wall-clock)."""

    modelled_compute_s: float
    modelled_comm_s: float
    host_compute_s: float      # forward + backward, one process among the run's, timed now
    host_comm_s: float         # the step's messages through this machine's loopback: α and bytes/s
    overlapped: bool           # communication runs during backward, on the cores the compute needs


def round_up(x: float) -> float:
    """x rounded up to two significant digits (a D that reads well in a config: 24, 130, 4100)."""
    if x <= 1:
        return 1.0
    exponent = math.floor(math.log10(x))
    step = 10.0 ** (exponent - 1)
    return float(round(math.ceil(x / step - 1e-9) * step, max(0, 1 - exponent)))


def choose(costs: Costs) -> float:
    """D for these costs: AUTO_MARGIN x the larger of host/modelled for compute and for communication."""
    host = costs.host_compute_s + (costs.host_comm_s if costs.overlapped else 0.0)
    ratios = [host / costs.modelled_compute_s if costs.modelled_compute_s > 0 else 0.0,
              costs.host_comm_s / costs.modelled_comm_s if costs.modelled_comm_s > 0 else 0.0]
    return round_up(AUTO_MARGIN * max(ratios))


@contextlib.contextmanager
def spinning(n: int) -> Iterator[None]:
    """`n` processes spinning on the CPU for the block: the run's other processes, all computing."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _host_compute_s(workload: Any, batch: Any, threads: int) -> float:
    """The median of three timed forward+backward passes (after one untimed), on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            workload.loss_fn(workload.model, batch).backward()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return statistics.median(times[1:])


def messages(cfg: Config, p: Any, m: Any) -> float:
    """Messages the busiest process of a step handles on this host, each paying α once: a worker's, the
    Prediction's messages in sequence x CommModel.buckets (collectives or partitions per message: a PS worker's
    request and reply per partition per server); where there are servers, one of them serves every worker's
    share of its partitions, world_size / servers times a worker's."""
    worker = p.messages * m.buckets
    services = registry.spec_of(cfg).service_nodes(cfg)
    server = worker * cfg.backend.world_size / services if p.server is not None and services else 0.0
    return max(worker, server)


def measure(cfg: Config, threads: int = 1) -> Costs:
    """This workload's modelled step on the cluster and its cost on this machine now, beside the run's
    other processes (`spinning`; a rank computes on `threads` threads)."""
    from psarch.theory import WIRE_OVERHEAD, cluster_step_time, predict
    from psarch.workload import build_workload
    with torch.random.fork_rng(devices=[]):   # the launcher's random state stays as it was
        workload = build_workload(cfg)
        batch = workload.batch(0, 0, cfg.backend.world_size)
        flops = count(workload.model, workload.loss_fn, batch)
    phi = sum(p.numel() for p in workload.model.parameters() if p.requires_grad)   # what moves
    p, c, spec = predict(cfg, phi), cfg.cluster, registry.spec_of(cfg)
    m = spec.comm_model(cfg, phi, {})
    modelled_comm = cluster_step_time(p, 0.0, c.link_mbps, c.server_mbps)["comm_s"]
    probe = int(min(max(p.worker.sent, p.worker.received, MIN_PROBE_BYTES), MAX_PROBE_BYTES))
    with spinning(cfg.backend.world_size + spec.service_nodes(cfg) - 1):
        with torch.random.fork_rng(devices=[]):
            host_compute = _host_compute_s(workload, batch, threads)
        alpha, rate = (loopback_alpha(), loopback_bytes_per_s(probe)) if modelled_comm > 0 else (0.0, 1.0)
    host_mbps = rate * 8 / 1e6 * WIRE_OVERHEAD   # theory takes the headers off again
    host_comm = (cluster_step_time(p, 0.0, host_mbps, host_mbps)["comm_s"] + alpha * messages(cfg, p, m)
                 if modelled_comm else 0.0)
    return Costs((flops.forward + flops.backward) / device.flops_per_s(cfg), modelled_comm, host_compute, host_comm,
                 (m.overlap and m.buckets > 1) or m.hidden_passes > 0)


def calibrate(cfg: Config, d: float, run: Runner) -> tuple[float, float]:
    """The run itself, CALIBRATION_STEPS steps of it at D = `d` (by `run`, the launcher's) into a folder that is
    then deleted: what this machine adds to its step, in wall-clock seconds (measured less predicted, in the
    cluster's time, x d; 0 if none), and the predicted step (the cluster's seconds). Stragglers and jitter are
    left out (their time is the cluster's)."""
    from psarch.theory import cluster_step
    c, t = cfg.cluster, cfg.train
    probe = dataclasses.replace(cfg, cluster=dataclasses.replace(c, dilation=d, slow_workers=[], jitter=0.0),
                                train=dataclasses.replace(t, steps=CALIBRATION_STEPS, warmup_steps=1,
                                                          checkpoint_every=0, log_every=CALIBRATION_STEPS))
    with tempfile.TemporaryDirectory(prefix="psarch-calibration-") as folder:
        summary = run(probe, out=Path(folder) / "run", echo=False, machine_checked=True, progress=False)
    st = cluster_step(probe, summary)
    return max(0.0, st["measured_s"] - st["predicted_s"]) * d, st["predicted_s"]


def serial_rule(host_s: float, predicted_s: float, d: float) -> float:
    """D at which `host_s` (wall-clock seconds this machine adds to a step, in sequence with the links and the
    device: TCP, the processes' turns on the cores) is at most HOST_SHARE of the predicted step; no less than
    `d`, and at most MAX_RAISE x d."""
    return min(MAX_RAISE * d, max(d, round_up(host_s / (HOST_SHARE * predicted_s)))) if predicted_s > 0 else d


def resolve(cfg: Config, run: Runner, echo: bool = True, threads: int = 1) -> Config:
    """cfg with cluster.dilation a number: as given; 1 without a modelled device or without emulate; else
    picked from this machine's costs (`choose`; a rank computes on `threads` threads), then raised until what
    a short run of it at that D (by `run`: psarch.launch.ranks.run, which calls this) adds to the step is small
    (`calibrate`, `serial_rule`), saying why in one line when `echo`."""
    c = cfg.cluster
    if c.dilation != "auto":
        return cfg
    d = 1.0
    if device.modelled(cfg) and c.emulate:
        costs = measure(cfg, threads)
        first = choose(costs)
        host_s, predicted_s = calibrate(cfg, first, run)
        d = serial_rule(host_s, predicted_s, first)
        if echo:
            print(f"psarch: cluster.dilation = \"auto\" -> {d:g}: beside the run's other processes, a worker's "
                  f"step computes here in {costs.host_compute_s * 1e3:.1f} ms against "
                  f"{costs.modelled_compute_s * 1e3:.3g} ms modelled on {device.name(cfg)}, and its messages cost "
                  f"{costs.host_comm_s * 1e3:.3g} ms on loopback against {costs.modelled_comm_s * 1e3:.3g} ms on "
                  f"the links{' (during backward)' if costs.overlapped else ''}; margin x{AUTO_MARGIN:g}: D = "
                  f"{first:g}. {CALIBRATION_STEPS} steps of the run at D = {first:g} took {host_s * 1e3:.3g} ms of "
                  f"this machine's time a step beyond the predicted {predicted_s * 1e3:.3g} ms: D = {d:g} makes that "
                  f"at most {HOST_SHARE:.0%} of the step" + (f" (at most x{MAX_RAISE:g})" if d == MAX_RAISE * first
                                                            else ""), flush=True)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(c, dilation=d))
