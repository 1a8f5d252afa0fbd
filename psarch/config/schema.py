"""The Config schema: one experiment's sections and their options as typed dataclasses ([workload]'s in
workload.py, [backend]'s in backend.py). It imports no loader, so any module may import Config from here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from psarch.config.backend import CoreBackendConfig
from psarch.config.faults import FaultsConfig
from psarch.config.fields import option, section
from psarch.config.workload import WorkloadConfig


@dataclass
class TrainConfig:
    """The step loop and the optimizer; the same for every backend."""

    steps: int = option(20, "optimizer steps to run", min=1)
    global_batch: int = option(16, "samples per step across all workers", min=1)
    optimizer: str = option("adamw", "optimizer", choices=("sgd", "adamw", "adagrad"))
    lr: float = option(1e-3, "learning rate", min=0.0)
    momentum: float = option(0.0, "SGD momentum", min=0.0)
    nesterov: bool = option(False, "SGD Nesterov momentum")
    weight_decay: float = option(0.0, "weight decay (decoupled for AdamW, L2 for SGD and Adagrad)", min=0.0)
    betas: list = option([0.9, 0.999], "AdamW betas [beta1, beta2]")
    eps: float = option(1e-8, "AdamW/Adagrad epsilon", min=0.0)
    initial_accumulator_value: float = option(0.0, "Adagrad: starting value of every squared-gradient sum", min=0.0)
    precision: str = option("fp32", "compute precision; bf16/fp16 keep fp32 master weights", choices=("fp32", "bf16", "fp16"))
    trainable: list = option([], "names or glob patterns (fnmatch) of the parameters that train, the rest frozen: no "
                                 "gradient, optimizer state or traffic ([]: all, or with lora_rank > 0 the adapters "
                                 "only), e.g. [\"head.*\", \"*.ln*\"]")
    lora_rank: int = option(0, "LoRA: rank r of the adapters added to the lora_targets linear layers, which then "
                               "train alone with what train.trainable names (0: no adapters)", min=0)
    lora_alpha: float = option(16.0, "LoRA: the adapters' output is scaled by lora_alpha / lora_rank", min=0.0)
    lora_targets: list = option(["*"], "LoRA: names or glob patterns of the nn.Linear modules that get adapters "
                                       "(e.g. [\"*.qkv\", \"*.proj\"])")
    log_every: int = option(10, "print a progress line every this many steps", min=1)
    trace_steps: list = option([], "steps whose timeline each rank records (compute, each communication call) into "
                                   "<run>/trace.json, the Chrome trace format Perfetto opens; negative counts from "
                                   "the end (-1: the last step); []: none, nothing timed")
    warmup_steps: int = option(-1, "steps left out of timing medians (-1: min(5, steps // 5))", min=-1)
    checkpoint_every: int = option(0, "write a checkpoint under <run>/checkpoints/ every this many steps (0: never)", min=0)
    keep_checkpoints: int = option(0, "keep only the newest this many checkpoints (0: all)", min=0)
    compression: str = option("none", "how gradients are compressed on the wire: cast to 2 bytes ('fp16', 'bf16'), the "
                                      "largest topk_ratio of each bucket with error feedback ('topk'), or PowerSGD's "
                                      "rank-r factors with error feedback and warm start ('powersgd'); PS GEO "
                                      "compresses its deltas both ways (pushes and pulls); beside embedding rows "
                                      "(backend.embeddings) the dense gradients only, the rows moving whole",
                              choices=("none", "fp16", "bf16", "topk", "powersgd"))
    topk_ratio: float = option(0.01, "compression = 'topk': the fraction of each bucket's elements sent", min=1e-9, max=1.0)
    powersgd_rank: int = option(1, "compression = 'powersgd': the rank r of each gradient matrix's approximation", min=1)
    powersgd_warmup_steps: int = option(10, "compression = 'powersgd': steps all-reduced uncompressed before PowerSGD "
                                            "starts (torch's start_powerSGD_iter)", min=0)
    tensorboard: bool = option(False, "also write each progress line's loss, samples/s and bytes sent as TensorBoard "
                                      "scalars under <run>/tensorboard/ (pip install psarch[tensorboard])")


def _device_names() -> tuple[str, ...]:
    from psarch.cluster.device import AUTO, CORE, MEASURED, PROFILES   # its package imports this module
    return (AUTO, CORE, MEASURED, *PROFILES)


@dataclass
class ClusterConfig:
    """An emulated cluster (a network namespace and a shaped link per node; needs root) and stragglers."""

    emulate: bool = option(False, "every worker and service process (PS server) is a node with its own network "
                                  "namespace and link")
    link_mbps: float = option(1000.0, "each node's link in Mbit/s, in each direction (full duplex)", min=0.001)
    server_link_mbps: float = option(0.0, "service nodes' (PS servers') links in Mbit/s; 0 = same as link_mbps",
                                     min=0.0, per_backend=True)
    slow_workers: list = option([], "ranks of workers that compute slower (works with emulate = false too)")
    slowdown: float = option(1.0, "slow workers' compute time is multiplied by this", min=1.0)
    jitter: float = option(0.0, "every worker's compute time is multiplied by exp(N(0, jitter)) each step, seeded",
                           min=0.0)
    device: str = option("auto", "the device every worker stands for: 'cpu-core' is this machine's core measured "
                                 "alone (the run's model, one process, one thread); 'cpu-measured' computes as this "
                                 "machine does, contention included; a profile's workers compute for real, then wait "
                                 "out the step's modelled time, FLOPs / (peak TFLOPS x mfu); 'auto': 'cpu-core' where "
                                 "emulate, else 'cpu-measured'", choices=_device_names)
    device_tflops: float = option(0.0, "a custom device's peak TFLOPS at train.precision (with 'auto' or "
                                       "'cpu-measured'), or cpu-core's rate instead of measuring it (0: measured; "
                                       "mfu does not apply to it)", min=0.0)
    device_mem_gbps: float = option(0.0, "a custom device's (or cpu-core's) memory bandwidth in GB/s: what prices "
                                         "memory-bound work, top-k's selection (0: not known, that work unpriced; a "
                                         "profile's is its data sheet's)", min=0.0)
    mfu: float = option(0.4, "model FLOPs utilisation in (0, 1]: the fraction of the device's peak the workload "
                             "attains", min=0.0, max=1.0)
    dilation: float | str = option("auto", "the emulation runs D times slower than the cluster: links at link_mbps / D, "
                                           "modelled compute x D, every reported time / D ('auto': the smallest D, with "
                                           "margin, that this machine's compute and per-message costs fit; 1 without a "
                                           "modelled device or without emulate)", min=1.0, named=("auto",))

    @property
    def server_mbps(self) -> float:
        """A service node's link rate in Mbit/s (server_link_mbps, or link_mbps where that is 0)."""
        return self.server_link_mbps or self.link_mbps


# keys that change no run, only how reports read it: a sweep does not run a point again for them, and
# `--resume` may change them
REPORT_ONLY = ("convergence_target",)


@dataclass
class Config:
    """One experiment."""

    name: str = option("", "run name (default: the config file's stem)")
    label: str = option("", "a run's name in reports and plots; default: its folder")
    seed: int = option(0, "global seed: model init and every step's global batch derive from it", min=0)
    out: str = option("", "run folder (default: runs/<name>)")
    convergence_target: float = option(0.1, "psarch compare's convergence target (changes no run): a run has reached it "
                                       "once its 10-step mean gap to the entropy floor falls below this fraction of "
                                       "its workload's initial gap (compare --target-gap gives an absolute gap instead)",
                                       min=0.001, max=1.0)
    workload: WorkloadConfig = section(WorkloadConfig)
    train: TrainConfig = section(TrainConfig)
    backend: Any = section(CoreBackendConfig, "How workers synchronise: the core's options and the chosen "
                           "backend's own (`psarch keys`); its class is the backend's (BackendSpec.options)")
    cluster: ClusterConfig = section(ClusterConfig)
    faults: FaultsConfig = section(FaultsConfig)
    started_from: dict = option({}, "the checkpoint a --from run started from: path, step and the config_sha256 of "
                                    "the run that wrote it (kept when the run is resumed)", recorded=True)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
