"""cluster.dilation = "auto": the D an emulated cluster of virtual devices runs at, picked once, in the
launcher, before any rank starts (every rank and every link must use the same D); and what D stretches
besides the links and the compute: every wait a run may time out on.

D must stretch the cluster's times past what this machine spends on them, with margin. Both are measured
here by probes of this machine alone, while `processes - 1` helper processes spin on the CPU in place of the
run's other ranks and servers (all computing at once, as a synchronous step starts): the contention the run
itself will bring, beside whatever else the machine is running now. No prediction of the step's time is
read, and the run itself is not tried (an instrument tuned until it agrees with the model it checks could
meet a wrong model halfway):
- compute: a worker's real forward and backward on one thread, beside the spinning processes (the slowest
  of COMPUTE_PASSES: the run meets the worst of the load that comes and goes), must fit
  inside its modelled compute x D;
- communication: the host's own cost of the step's messages must fit inside that link's time on the cluster x
  D: a cost per message, paid once per message the busiest process handles (a worker's every bucket, or a
  server's every worker's partitions, `messages`), and bytes/s of one stream on this machine's loopback for
  the bytes the busiest link carries. The cost per message is timed on the backend's own code path
  (BackendSpec.message_probe, psarch.cluster.messages: a PS's pushpulls through a real server with the run's
  workers and partitions, a ring hop over gloo), its two processes beside `processes - 2` spinning ones (so as
  many busy as the run's); a backend that names none pays α of a TCP ping-pong on loopback. The messages and
  bytes are the config's counts from its step program (program_load: the messages the busiest node sends and
  receives, the bytes of its busiest link and direction; theory.predict's bytes only where the backend writes no
  program), never a time. Where the program communicates before its compute is over (buckets
  from backward's hooks, passes inside compute), that cost competes with the compute for the same cores, and
  counts on its side too.
D = AUTO_MARGIN x the larger of the two ratios, at least 1, rounded up to two significant digits.

Timeouts are host seconds, and D stretches every legitimate wait D times: `stretched` multiplies every
backend option that is a timeout (`*timeout_s`: backend.timeout_s, a PS's heartbeat, handshake and resend
timeouts) by D in the config the ranks and services get, so the process group's and the store's waits,
the PS's barrier, save and pull deadlines and the launcher's stall limit all count in the cluster's time.

What no D stretches: TCP's own timers (delayed ACKs, the 200 ms minimum retransmission timeout) and the
host's per-message latency α, which are the same wall-clock times at every D, so D times shorter in the
cluster's time than on the host. The emulated cluster's α is α / D (reported beside the results).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from psarch import registry
from psarch.cluster import device
from psarch.cluster.alpha import loopback_alpha, loopback_bytes_per_s
from psarch.cluster.flops import count
from psarch.cluster.messages import per_message_s, spinning

AUTO_MARGIN = 2.0
COMPUTE_PASSES = 5   # a worker's forward and backward timed beside the spinning processes, the slowest taken
# The loopback's bytes/s is measured on a stream of the step's payload, within these bounds: at least 8 MiB,
# so one delayed wake-up of the receiving thread does not pass for a slow stream.
MIN_PROBE_BYTES, MAX_PROBE_BYTES = 8 * 2**20, 32 * 2**20
HOUR_S = 3600.0   # a run estimated past this says so before it starts

if TYPE_CHECKING:
    from psarch.backend import BackendSpec
    from psarch.config import Config
    from psarch.theory import Prediction


@dataclass(frozen=True)
class Costs:
    """A step of one worker: modelled on the cluster (cluster time) and spent by this machine (wall-clock)."""

    modelled_compute_s: float
    modelled_comm_s: float
    host_compute_s: float      # forward + backward, one process among the run's, timed now
    host_comm_s: float         # the step's messages on this machine: a cost per message and bytes/s
    overlapped: bool           # communication runs during backward, on the cores the compute needs
    message_s: float = 0.0     # the probes: a message's cost on the backend's code path (`message_path`) and bytes/s
    host_bytes_per_s: float = 0.0   # of this machine's loopback, beside the spinning processes
    message_path: str = ""


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


def _host_compute_s(workload: Any, batch: Any, threads: int) -> float:
    """The slowest of COMPUTE_PASSES timed forward+backward passes (after one untimed), on `threads` threads:
    the run's steps meet the worst of the load that comes and goes, not its middle."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for _ in range(COMPUTE_PASSES + 1):
            t0 = time.perf_counter()
            workload.loss_fn(workload.model, batch).backward()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return max(times[1:])


@dataclass(frozen=True)
class Load:
    """What a step's program puts on the busiest node: the messages it handles (each paying α once), the bytes of its
    busiest link and direction, whether that link is a service node's (cluster.server_link_mbps), and whether any
    communication starts before its compute is over."""

    messages: float
    link_bytes: float
    server_link: bool
    during: bool


def program_load(cfg: Config, phi: float, compute_s: float) -> Load | None:
    """From the step's program in full (BackendSpec.program), played once with the modelled compute, per training
    step: the messages the busiest node handles (every message it sends and every one it receives: a ring rank's
    2(N-1) of each per bucket, a PS worker's push and pull per partition per server, a server's every worker's
    share), the bytes of the busiest link and direction (a worker's node, a server's, or a node with both), and
    whether any communication starts before its node's compute is over (during forward and backward, on the cores
    the compute needs: buckets from backward's hooks, passes that block inside compute). None where the backend
    writes no program."""
    from psarch.theory import program_on_links
    from psarch.theory.program import SERVER, Transfer
    from psarch.theory.simulate import play

    got = program_on_links(cfg, phi, compute_s, None, 0.0)
    if got is None:
        return None
    program = got[0]
    ops, start, end = play(*got)
    handled: dict[int, float] = {}
    moved: dict[tuple[int, str], float] = {}
    busy_until: dict[int, float] = {}
    for name, op in ops.items():
        if isinstance(op, Transfer):
            for node, way in ((op.src, "sent"), (op.dst, "received")):
                handled[node] = handled.get(node, 0.0) + op.messages
                moved[node, way] = moved.get((node, way), 0.0) + op.bytes
        elif op.seconds > 0:
            busy_until[op.node] = max(busy_until.get(op.node, 0.0), end[name])
    during = any(start[name] < busy_until.get(node, 0.0) * (1 - 1e-9)
                 for name, op in ops.items() if isinstance(op, Transfer) for node in (op.src, op.dst))
    (node, _), nbytes = max(moved.items(), key=lambda x: x[1], default=((0, ""), 0.0))
    return Load(max(handled.values(), default=0.0) / program.steps, nbytes / program.steps,
                program.nodes[node][0] == SERVER if moved else False, during)


@dataclass(frozen=True)
class ModelledStep:
    """What the cluster spends on this config, from the device and the link rates (cluster seconds), and what
    they were counted from: the workload, a worker's batch, the config's bytes (Prediction) and its step program's
    load (None: the backend writes no program)."""

    workload: Any
    batch: Any
    counts: Prediction
    phi: float         # the parameters that train
    compute_s: float   # a worker's modelled forward and backward, a step
    link_s: float      # the busiest link's bytes a step at its rate
    model_s: float     # the model's bytes over a worker's link, twice (its first broadcast, its final gather)
    load: Load | None = None


def modelled(cfg: Config) -> ModelledStep:
    """This config's step on the cluster it stands for (a modelled device)."""
    from psarch.theory import predict
    from psarch.cluster.core import probe_workload
    with torch.random.fork_rng(devices=[]):   # the launcher's random state stays as it was
        workload = probe_workload(cfg)   # its tables held (a worker of PS rows would read a compact table)
        batch = workload.batch(0, 0, cfg.backend.world_size)
        flops = count(workload.model, workload.loss_fn, batch)
    params = list(workload.model.parameters())
    phi = sum(x.numel() for x in params if x.requires_grad)
    p = predict(cfg, phi)   # what moves
    compute = (flops.forward + flops.backward) / device.flops_per_s(cfg)
    load = program_load(cfg, phi, compute)
    # no program: a worker's bytes, its messages in sequence, none during compute
    nbytes, server = (load.link_bytes, load.server_link) if load else (max(p.link.sent, p.link.received), False)
    c = cfg.cluster
    return ModelledStep(workload, batch, p, phi, compute,
                        nbytes * 8 / ((c.server_mbps if server else c.link_mbps) * 1e6),
                        2 * sum(x.numel() * x.element_size() for x in params) * 8 / (c.link_mbps * 1e6), load)


def measure(cfg: Config, threads: int = 1, cluster: ModelledStep | None = None) -> Costs:
    """This workload's modelled step on the cluster (`cluster`, or counted here) and its cost on this machine
    now, beside the run's other processes (`spinning`; a rank computes on `threads` threads)."""
    k = cluster or modelled(cfg)
    p, spec = k.counts, registry.spec_of(cfg)
    messages, during = (k.load.messages, k.load.during) if k.load else (p.messages, False)
    probe = int(min(max(p.link.sent, p.link.received, MIN_PROBE_BYTES), MAX_PROBE_BYTES))
    processes = cfg.backend.world_size + spec.service_nodes(cfg)
    with spinning(processes - 1):
        with torch.random.fork_rng(devices=[]):
            host_compute = _host_compute_s(k.workload, k.batch, threads)
        rate = loopback_bytes_per_s(probe) if k.link_s > 0 else 0.0
    message, path = message_cost(cfg, spec, k.phi, processes) if k.link_s > 0 else (0.0, "")
    nbytes = k.load.link_bytes if k.load else max(p.link.sent, p.link.received)
    host_comm = nbytes / rate + message * messages if k.link_s > 0 else 0.0
    return Costs(k.compute_s, k.link_s, host_compute, host_comm, during, message, rate, path)


def message_cost(cfg: Config, spec: BackendSpec, phi: float, processes: int) -> tuple[float, str]:
    """Seconds per message on this machine and what was timed: the backend's own code path (its probe's two
    processes beside `processes - 2` spinning), else α of a TCP ping-pong on loopback (beside `processes - 1`)."""
    probe = spec.message_probe(cfg, phi)
    if probe is None:
        with spinning(processes - 1):
            return loopback_alpha(), "a TCP ping-pong on loopback"
    return per_message_s(probe, processes), probe.family   # spins beside the probe where it measures


def stretched(cfg: Config) -> Config:
    """cfg with every backend timeout (`*timeout_s`) x D, its dilation (a number): a wait that D stretches
    D times then fails no later, in the cluster's time, than the config says."""
    d = device.dilation(cfg)
    if d == 1:
        return cfg
    b = cfg.backend
    waits = {f.name: getattr(b, f.name) * d for f in dataclasses.fields(b) if f.name.endswith("timeout_s")}
    return dataclasses.replace(cfg, backend=dataclasses.replace(b, **waits))


def wall_s(cfg: Config, k: ModelledStep) -> float:
    """The run's estimated wall time, its processes' start-up left out: its steps, each the slowest worker's
    modelled compute (a straggler's slowdown; jitter left out) and the busiest link's time (no overlap
    counted, so rather more than less), and the model's way in and out, x D."""
    c = cfg.cluster
    slowest = c.slowdown if c.slow_workers else 1.0
    return (cfg.train.steps * (k.compute_s * slowest + k.link_s) + k.model_s) * device.dilation(cfg)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 2 * HOUR_S \
        else f"{seconds / HOUR_S:.1f} h"


def resolve(cfg: Config, echo: bool = True, threads: int = 1) -> Config:
    """The config the ranks and services run: the device measured where it is this machine's core
    (psarch.cluster.core), cluster.dilation a number (as given; 1 without a modelled device or without
    emulate; else `choose` from this machine's costs, a rank computing on `threads` threads), and every
    timeout stretched by D. With `echo`, one line first on an emulated cluster: the device, D and why, and
    the run's estimated wall time (and a line more where that passes an hour)."""
    from psarch.cluster import core
    c, said = cfg.cluster, ""
    if device.chosen(cfg) == device.CORE:
        if c.device_tflops == 0:
            rate = core.flops_per_s(cfg)
            said = f"this machine's core alone, measured at {rate / 1e9:.3g} GFLOP/s on this model"
        else:
            rate, said = c.device_tflops * 1e12, f"this machine's core, given as {c.device_tflops * 1e3:.3g} GFLOP/s"
        c = dataclasses.replace(c, device=device.CORE, device_tflops=rate / 1e12)
    elif device.modelled(cfg):
        what = device.name(cfg)
        said = f"{'a' if what == 'custom device' else 'device'} {what} at {device.flops_per_s(cfg) / 1e12:.3g} TFLOP/s"
    if not c.emulate:   # loopback cannot be slowed: D = 1, and no wait is stretched
        return dataclasses.replace(cfg, cluster=dataclasses.replace(c, dilation=1.0 if c.dilation == "auto"
                                                                    else c.dilation))
    cfg = dataclasses.replace(cfg, cluster=c)
    k = modelled(cfg) if device.modelled(cfg) else None
    if k is None:   # cpu-measured: compute as this machine does, D = 1
        d, why = 1.0, "compute as contended here (cpu-measured), so no dilation"
    elif c.dilation == "auto":
        costs = measure(cfg, threads, k)
        d = choose(costs)
        why = (f"beside the run's other processes a worker's step computes here in {costs.host_compute_s * 1e3:.3g} ms "
               f"against {costs.modelled_compute_s * 1e3:.3g} ms modelled, and its messages cost "
               f"{costs.host_comm_s * 1e3:.3g} ms here ({costs.message_s * 1e6:.0f} us a message, timed on "
               f"{costs.message_path}; loopback at {costs.host_bytes_per_s / 1e6:.0f} MB/s) against "
               f"{costs.modelled_comm_s * 1e3:.3g} ms on the busiest link"
               f"{' (during backward)' if costs.overlapped else ''}; margin x{AUTO_MARGIN:g}")
    else:
        d, why = float(c.dilation), "as given"
    cfg = stretched(dataclasses.replace(cfg, cluster=dataclasses.replace(c, dilation=d)))
    if echo:
        line = f"psarch: each worker stands for {said or 'this machine, contention included'}; D = {d:g}: {why}"
        est = wall_s(cfg, k) if k is not None else 0.0
        if k is not None:
            line += f"; estimated wall time {_duration(est)} ({cfg.train.steps} steps and the model in and out)"
        print(line, flush=True)
        if est > HOUR_S:
            print(f"psarch: this run is estimated at over an hour of wall time ({_duration(est)}), its processes' "
                  f"start-up left out; fewer train.steps, or a lower cluster.dilation, shortens it", flush=True)
    return cfg
