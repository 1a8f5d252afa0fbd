"""Virtual devices: the device every worker of a run stands for, and the time dilation D of the emulation.

With a modelled device (`cluster.device` a profile, or `cluster.device_tflops`), a worker computes for real
(real gradients: convergence is real), then waits out the rest of the step's modelled compute time,
FLOPs / (peak x mfu), with FLOPs counted once by torch's own FlopCounterMode (psarch.cluster.flops) and the
wait placed through forward and backward as the device would spend it (psarch.cluster.pacing). The
emulation may run D times slower than the cluster it stands for: links shaped at link_mbps / D, modelled
compute x D, every reported time / D, so the host's own costs (8 ranks on 2 cores, per-message CPU time)
shrink by D against the cluster's. "auto" picks D (psarch.cluster.dilation).

On an emulated cluster with no device set (`device = "auto"`), every worker stands for this machine's own
core measured alone (`cpu-core`: the run's own model timed once in the launcher, one process, one thread,
psarch.cluster.core), paced like any device, so N ranks on a few cores stand for N machines with this CPU.
On loopback "auto" is `cpu-measured`: with no dilation there, a paced core would only overrun.

This module holds the facts of a config: the profiles, the modelled rate, D, and the config's rules.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from psarch.errors import ConfigError, show

if TYPE_CHECKING:   # records imports torch; this module does not
    from psarch.cluster.records import VirtualDeviceSummary
    from psarch.records import RankRecord

AUTO = "auto"               # the default: CORE on an emulated cluster, MEASURED on loopback
CORE = "cpu-core"           # this machine's core measured alone, paced as a virtual device (dilation applies)
MEASURED = "cpu-measured"   # no device model: compute takes what this machine takes, contention included
# Peak dense TFLOPS by train.precision, from NVIDIA's data sheets (SXM parts, no sparsity); fp32 without
# TF32, as PyTorch runs fp32 matmuls by default. The V100 has no bf16.
PROFILES: dict[str, dict[str, float]] = {
    "h100": {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0},
    "h200": {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0},   # the H100's processor with more, faster memory
    "a100": {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0},
    "v100": {"fp32": 15.7, "fp16": 125.0},
}
# Device memory of the same SXM parts, from NVIDIA's data sheets: H100 SXM5 80 GB HBM3, H200 SXM 141 GB HBM3e,
# A100 SXM4 80 GB HBM2e
# (the 80 GB part), V100 SXM2 32 GB HBM2 (the 32 GB part). Counted as 1e9 bytes a GB, a little under what the
# parts hold (their GB are nearer 2**30 bytes), so a plan's "fits" errs on the safe side.
MEMORY_GB: dict[str, float] = {"h100": 80.0, "h200": 141.0, "a100": 80.0, "v100": 32.0}
# Their memory bandwidth in GB/s, from the same data sheets: what prices memory-bound work (top-k's selection)
MEMORY_GBPS: dict[str, float] = {"h100": 3350.0, "h200": 4800.0, "a100": 2039.0, "v100": 900.0}

if TYPE_CHECKING:
    from psarch.config import Config


def profile_of(device_name: str) -> str | None:
    """The profile a real device is, by its name (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3" is
    "h100"), or None."""
    return next((k for k in PROFILES if k in device_name.lower()), None)


def chosen(cfg: Config) -> str:
    """The device cluster.device names once "auto" is settled: CORE on an emulated cluster, MEASURED on
    loopback or where device_tflops gives a custom device; else the name itself."""
    c = cfg.cluster
    if c.device != AUTO:
        return c.device
    return CORE if c.emulate and c.device_tflops == 0 else MEASURED


def modelled(cfg: Config) -> bool:
    """Whether the workers compute as a modelled device (a profile, this core alone or device_tflops), not
    as this machine does with its contention."""
    return chosen(cfg) != MEASURED or cfg.cluster.device_tflops > 0


def name(cfg: Config) -> str:
    """The device in words: the profile's name, "cpu-core", or "custom device"."""
    d = chosen(cfg)
    return d if d != MEASURED else "custom device"


def peak_tflops(cfg: Config) -> float:
    """The device's peak TFLOPS at train.precision (this core's measured rate for CORE)."""
    c = cfg.cluster
    if chosen(cfg) == CORE and c.device_tflops == 0:
        raise RuntimeError(f"cluster.device = \"{CORE}\" was not measured: psarch.cluster.dilation.resolve(cfg) "
                           f"times this machine's core once, in the launcher, before any rank starts")
    return c.device_tflops or PROFILES[c.device][cfg.train.precision]


def mfu(cfg: Config) -> float:
    """The fraction of the peak the workload attains: 1 for CORE (its rate is the workload's own, measured)."""
    return 1.0 if chosen(cfg) == CORE else cfg.cluster.mfu


def flops_per_s(cfg: Config) -> float:
    """The rate the modelled device computes at: peak x mfu, in FLOP/s."""
    return peak_tflops(cfg) * mfu(cfg) * 1e12


def rates(cfg: Config) -> tuple[float, float]:
    """(FLOP/s, memory bytes/s) of the modelled device, each 0 where it is not known: no modelled device, this core
    not measured yet, or no memory bandwidth (a custom device or this core without cluster.device_mem_gbps)."""
    c = cfg.cluster
    flops = flops_per_s(cfg) if modelled(cfg) and (c.device_tflops or chosen(cfg) in PROFILES) else 0.0
    return flops, (c.device_mem_gbps or MEMORY_GBPS.get(chosen(cfg), 0.0)) * 1e9


def as_paced(cfg: Config, facts: VirtualDeviceSummary | None) -> Config:
    """`cfg` as a finished run's ranks were paced: this core's rate from its summary's `virtual_device` (`facts`)
    where the config left it to be measured (CORE without device_tflops: the launcher's config keeps what was
    asked), so a prediction prices a compression's work at the rate the ranks paced it at; else `cfg`."""
    import dataclasses
    if facts is None or chosen(cfg) != CORE or cfg.cluster.device_tflops or not facts.get("peak_tflops"):
        return cfg
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device=CORE,
                                                                device_tflops=facts["peak_tflops"]))


def dilation(cfg: Config) -> float:
    """D: 1 without a modelled device or without emulate; the number the config (or the launcher's
    psarch.cluster.dilation.resolve) gives otherwise."""
    c = cfg.cluster
    if not (modelled(cfg) and c.emulate):
        return 1.0
    if c.dilation == "auto":
        raise RuntimeError("cluster.dilation = \"auto\" was not resolved: psarch.cluster.dilation.resolve(cfg) "
                           "picks D once, in the launcher, before any rank starts")
    return float(c.dilation)


def shaped_mbps(cfg: Config) -> tuple[float, float]:
    """The rates an emulated cluster shapes its links to, (worker link, service link) in Mbit/s: the
    cluster's / D."""
    d = dilation(cfg)
    return cfg.cluster.link_mbps / d, cfg.cluster.server_mbps / d


def check(cfg: Config) -> None:
    """The device's and dilation's rules, one ConfigError each."""
    c, precision = cfg.cluster, cfg.train.precision
    if c.mfu <= 0:
        raise ConfigError(f"cluster.mfu = {show(c.mfu)}: must be in (0, 1]")
    if c.device in PROFILES and c.device_tflops > 0:
        raise ConfigError(f"cluster.device_tflops = {c.device_tflops:g}: a custom device replaces a profile; set "
                          f"cluster.device = \"{MEASURED}\" with it, or cluster.device_tflops = 0 with "
                          f"cluster.device = {show(c.device)}")
    if c.device in PROFILES and c.device_mem_gbps > 0:
        raise ConfigError(f"cluster.device_mem_gbps = {c.device_mem_gbps:g}: {show(c.device)}'s memory bandwidth is its "
                          f"data sheet's ({MEMORY_GBPS[c.device]:g} GB/s); give it to a custom device "
                          f"(cluster.device_tflops) or \"{CORE}\"")
    if c.device_mem_gbps > 0 and not modelled(cfg):
        raise ConfigError(f"cluster.device_mem_gbps = {c.device_mem_gbps:g}: needs a modelled device (cluster.device = "
                          f"\"{CORE}\" or cluster.device_tflops): measured compute prices nothing")
    if c.device in PROFILES and precision not in PROFILES[c.device]:
        raise ConfigError(f"cluster.device = {show(c.device)}: has no {precision} peak; it runs "
                          f"{', '.join(PROFILES[c.device])} (train.precision), or give cluster.device_tflops")
    if c.dilation == "auto" or c.dilation == 1:
        return
    if not modelled(cfg):
        raise ConfigError(f"cluster.dilation = {show(c.dilation)}: needs a modelled device (cluster.device = "
                          f"{', '.join(show(p) for p in (CORE, *PROFILES))}, or cluster.device_tflops): measured "
                          f"compute would be divided by D too")
    if not c.emulate:
        raise ConfigError(f"cluster.dilation = {show(c.dilation)}: needs cluster.emulate = true (only emulated "
                          f"links can run D times slower; on loopback D is 1)")


# ---------------------------------------------------------------- what a run reports

OVERRUN_WARN = 0.05   # a run where more than this fraction of timed steps overran says so


def summary(cfg: Config, records: list[RankRecord], timed: set[int]) -> VirtualDeviceSummary | None:
    """summary.json's `virtual_device` from the ranks' records (None without a modelled device): the device,
    its FLOPs and nominal times per worker-step, D, the median over timed steps of the slowest worker's
    modelled compute, and the timed steps whose real compute overran the modelled time: where workers step in
    lockstep, the steps in which any worker overran (every worker waits for it), else each worker's own."""
    from psarch import registry
    facts = next((r.virtual_device for r in records if r.virtual_device), None)
    if not modelled(cfg) or facts is None:
        return None
    steps = [x for r in records for x in r.steps if x["step"] in timed and "overrun" in x]
    slowest: dict[int, float] = {}
    overran: dict[int, bool] = {}
    for x in steps:
        slowest[x["step"]] = max(slowest.get(x["step"], 0.0), x["modelled_s"])
        overran[x["step"]] = overran.get(x["step"], False) or x["overrun"]
    lockstep = registry.spec_of(cfg).lockstep(cfg)
    flags = list(overran.values()) if lockstep else [x["overrun"] for x in steps]
    over = sum(flags)
    # the launcher's cfg leaves "auto" as asked; the ranks' facts hold the rate they were paced at
    nominal_s = facts["forward_s"] + facts["backward_s"]
    rate = (facts["forward_flops"] + facts["backward_flops"]) / nominal_s if nominal_s > 0 else 0.0
    peak = rate / 1e12 if chosen(cfg) == CORE else peak_tflops(cfg)
    out: VirtualDeviceSummary = {"device": name(cfg), "peak_tflops": peak, "mfu": mfu(cfg), **facts,
           "compute_s": statistics.median(slowest.values()) if slowest else None,
           "overrun_steps": over, "counted_steps": len(flags), "overrun_fraction": over / len(flags) if flags else 0.0,
           "overrun_of": "steps" if lockstep else "worker-steps",
           "times": "cluster time: every time reported is the wall clock / dilation"}
    out["warning"] = overrun_line(out)
    return out


def overrun_line(vd: VirtualDeviceSummary) -> str | None:
    """The one line a run whose steps overran too often ends with (None where they did not)."""
    if vd["overrun_fraction"] <= OVERRUN_WARN:
        return None
    return (f"virtual device: {vd['overrun_steps']} of {vd['counted_steps']} timed {vd['overrun_of']} "
            f"({vd['overrun_fraction']:.0%}) overran their modelled compute: this machine, not the "
            f"{vd['device']}, set their time; raise cluster.dilation (it is {vd['dilation']:g})")


def report_lines(vd: VirtualDeviceSummary, alpha_s: float | None) -> list[str]:
    """report.txt's lines on the virtual device, the overrun line last (where there is one)."""
    d = vd["dilation"]
    lines = [f"virtual device  {vd['device']} ({vd['peak_tflops']:g} TFLOPS x mfu {vd['mfu']:g}): "
             f"{vd['forward_flops'] / 1e9:.3g} + {vd['backward_flops'] / 1e9:.3g} GFLOP per worker-step = "
             f"{vd['forward_s'] * 1e3:.3g} + {vd['backward_s'] * 1e3:.3g} ms forward + backward",
             f"time dilation   D = {d:g}: links shaped at link_mbps / D, modelled compute x D; every time above "
             f"is the cluster's (wall clock / D)"
             + (f"; alpha {alpha_s * 1e6:.0f} us on this host = {alpha_s / d * 1e6:.3g} us of cluster time"
                if alpha_s is not None else ""),
             f"overrun steps   {vd['overrun_steps']} of {vd['counted_steps']} timed {vd['overrun_of']} "
             f"({vd['overrun_fraction']:.1%})"]
    warn = overrun_line(vd)
    return lines + ([warn] if warn else [])
