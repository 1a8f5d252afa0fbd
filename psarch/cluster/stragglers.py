"""Stragglers: chosen workers compute slower (cluster.slow_workers, slowdown), every worker's compute time
varies from step to step (cluster.jitter). Works on loopback and on an emulated cluster alike.

A worker is slowed by sleeping, after its forward pass and before its backward pass, for
(m - 1) x its compute time, where m = slowdown (1 for the others) x exp(N(0, jitter)) drawn for each step
from a generator seeded by (seed, rank, step): two runs of one config, and a run resumed from a checkpoint,
see the same slow steps. A draw with
m < 1 sleeps 0 (a worker cannot be made faster). The sleep comes before backward because DDP and ZeRO
start communicating from gradient hooks during backward: there, "before it communicates" means before
backward; the PS, which communicates after backward, is delayed by the same amount. (ZeRO-3's forward
all-gathers are the exception: they run before the sleep.) The compute time is this step's forward time
plus the previous step's backward time (the current backward has not run yet; on the first step
2 x forward, the usual ratio), both measured on this worker.

Communication waited for inside forward and backward is not compute: ZeRO-3's blocking all-gathers
(forward and backward; what prefetching does not hide) and the reduce-scatters of ZeRO-1/2/3 waited for
in backward's hooks (all of them with overlap_comm = false; with it, the oldest whenever more than
MAX_IN_FLIGHT = 2 are in flight). The engines time those waits themselves (Trainer.comm_waited_s, a
running sum); the straggler subtracts what it grew by during its forward and its backward, so the
sleep is (m - 1) x compute alone, whatever the link's speed or the peers' lateness. DDP and the PS wait
only after backward (their sum stays 0); PyTorch's peers (torch_ddp, torch_zero, torch_fsdp) do not
report their waits, so for torch_fsdp the sleep still holds its in-hook communication.

With a modelled device (cluster.device, psarch.cluster.device) there is no sleep of this kind: the factor
m multiplies the device's modelled compute time (psarch.cluster.pacing), and may be below 1 (jitter
around the device's time; only measured compute cannot be made faster).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Any, Callable

import torch

from psarch import registry
from psarch.cluster import device
from psarch.cluster.call_pacing import CallDevice
from psarch.cluster.flops import count
from psarch.cluster.pacing import VirtualDevice
from psarch.config import Config
from psarch.cluster.records import PacedFields
from psarch.cluster.work_pacing import WorkClock
from psarch.workload import Workload


class Straggler:
    """Wraps a loss function so that each call sleeps as this worker's compute slowdown says."""

    def __init__(self, slowdown: float, jitter: float, seed: int, rank: int) -> None:
        self.slowdown, self.jitter, self.seed, self.rank = slowdown, jitter, seed, rank
        self.step = 0                 # the step being run, set by the runner: the jitter drawn is this step's
        self.forward_s = 0.0
        self.backward_s: float | None = None
        self.slept_s = 0.0            # the last step's sleep, reported in metrics.jsonl
        self.waited: Callable[[], float] = lambda: 0.0   # the trainer's comm_waited_s, once it is built
        self._bwd_t0 = self._bwd_w0 = 0.0

    def factor(self, step: int) -> float:
        """Step `step`'s compute-time multiplier (module function `factor`)."""
        return factor(self.seed, self.rank, step, self.slowdown, self.jitter)

    def fields(self) -> PacedFields:
        """What the step record carries: this step's sleep."""
        return {"slept_s": self.slept_s}

    def close(self) -> None:
        pass

    def wrap(self, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> Callable:
        def slowed(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            t0, w0 = time.perf_counter(), self.waited()
            loss = loss_fn(model, batch)
            self.forward_s = forward = time.perf_counter() - t0 - (self.waited() - w0)
            compute = forward + (self.backward_s if self.backward_s is not None else 2 * forward)
            self.slept_s = max(0.0, self.factor(self.step) - 1.0) * compute
            time.sleep(self.slept_s)
            if loss.requires_grad:
                loss.register_hook(self._backward_starts)
            return loss
        return slowed

    def _backward_starts(self, grad: torch.Tensor) -> None:
        self._bwd_t0, self._bwd_w0 = time.perf_counter(), self.waited()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self) -> None:
        self.backward_s = time.perf_counter() - self._bwd_t0 - (self.waited() - self._bwd_w0)


def factor(seed: int, rank: int, step: int, slowdown: float, jitter: float) -> float:
    """Step `step`'s compute-time multiplier, slowdown x exp(N(0, jitter)): a function of (seed, rank, step),
    not of the steps run before (a resumed run starts its draws at the checkpoint's step)."""
    if jitter == 0:
        return slowdown
    draw = random.Random(f"psarch-straggler-{seed}-{rank}-{step}")   # str seeds: stable across runs
    return slowdown * math.exp(draw.gauss(0.0, jitter))


def slowdown_of(cfg: Config, rank: int) -> float:
    """This worker's slowdown: cluster.slowdown if it is one of cluster.slow_workers, else 1."""
    return cfg.cluster.slowdown if rank in cfg.cluster.slow_workers else 1.0


def pacer(cfg: Config, rank: int, workload: Workload) -> "Straggler | VirtualDevice | CallDevice | None":
    """How this worker's compute is paced: as its modelled device, with slowdown and jitter multiplying
    the modelled time (its FLOPs counted here, once; call by call where the backend runs the loss function in
    parts, BackendSpec.paced_by_call); else as a straggler of this machine's compute; else not at all (None)."""
    if not device.modelled(cfg):
        return straggler(cfg, rank)
    c, slow = cfg.cluster, slowdown_of(cfg, rank)
    flops = count(workload.model, workload.loss_fn, workload.batch(0, rank, cfg.backend.world_size))
    if registry.spec_of(cfg).paced_by_call:   # whole-model FLOPs give the backward / forward ratio alone
        return CallDevice(flops, device.flops_per_s(cfg), device.dilation(cfg),
                          lambda step: factor(cfg.seed, rank, step, slow, c.jitter))
    return VirtualDevice(workload.model, flops, device.flops_per_s(cfg), device.dilation(cfg),
                         lambda step: factor(cfg.seed, rank, step, slow, c.jitter),
                         WorkClock(*device.rates(cfg), device.dilation(cfg)))


def straggler(cfg: Config, rank: int) -> Straggler | None:
    """This worker's Straggler, or None where it computes at its own speed."""
    slowdown = slowdown_of(cfg, rank)
    if slowdown == 1.0 and cfg.cluster.jitter == 0.0:
        return None
    return Straggler(slowdown, cfg.cluster.jitter, cfg.seed, rank)


def slowed(workload: Workload, s: "Straggler | VirtualDevice | CallDevice | None") -> Workload:
    """The workload with its loss function paced by `s` (unchanged when s is None)."""
    return workload if s is None else dataclasses.replace(workload, loss_fn=s.wrap(workload.loss_fn))
