"""Who this rank is and how it talks to the others: one object, passed explicitly."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from psarch.config import Config
from psarch.records import ServiceInfo


@dataclass
class DistContext:
    """This rank's place in the run. `group` is None for the default (world) process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dist_backend: str | None = None          # None: no process group (single, or PS workers that need none)
    group: Any = None
    launched_by: str = "local"               # "local" (psarch run) or "torchrun"
    services: ServiceInfo = field(default_factory=ServiceInfo)  # how to reach the services (PS servers)

    @property
    def distributed(self) -> bool:
        return self.dist_backend is not None

    def mean_across_ranks(self, value: float) -> float:
        """Average a number over all ranks (a collective call: every rank must make it)."""
        if not self.distributed or self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64,
                         device=self.device if self.dist_backend == "nccl" else "cpu")
        dist.all_reduce(t, group=self.group)
        return float(t.item()) / self.world_size


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.backend.device
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("backend.device = \"cuda\": no CUDA device is visible to this process")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def pick_dist_backend(cfg: Config, device: torch.device, local_world: int) -> str:
    """nccl when every local rank has a GPU of its own; gloo otherwise (CPU, or ranks sharing a GPU)."""
    if cfg.backend.dist_backend != "auto":
        if cfg.backend.dist_backend == "nccl" and device.type == "cuda" and local_world > torch.cuda.device_count():
            raise RuntimeError(f"backend.dist_backend = \"nccl\": {local_world} local ranks share "
                               f"{torch.cuda.device_count()} GPU(s); NCCL needs one GPU per rank (use gloo)")
        return cfg.backend.dist_backend
    if device.type == "cuda" and local_world <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def init_rank(cfg: Config, rank: int, world_size: int, local_rank: int, local_world: int,
              store: Any = None, launched_by: str = "local", needs_group: bool = True) -> DistContext:
    """Set up this rank: device, and (where the backend needs one) the process group."""
    device = pick_device(cfg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = DistContext(rank, world_size, local_rank, device, launched_by=launched_by)
    if needs_group:
        backend = pick_dist_backend(cfg, device, local_world)
        timeout = timedelta(seconds=max(cfg.backend.timeout_s, 1.0))
        kwargs: dict[str, Any] = {"timeout": timeout}
        if backend == "nccl":
            kwargs["device_id"] = device
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
        else:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
        ctx.dist_backend = backend
    return ctx


def shutdown(ctx: DistContext, destroy: bool = True) -> None:
    """Leave the run's group once every rank is here (no rank tears its sockets down while a peer still talks
    to it). A process that ends next with os._exit (lifecycle.leave) passes destroy=False and keeps its group:
    destroying it just after the last step can run the group's destructor on one of gloo's own threads (one a
    comm hook's callback ran on, still holding a reference), which then joins itself and aborts a process whose
    work is done ("Resource deadlock avoided", torch 2.13)."""
    if ctx.distributed and dist.is_initialized():
        dist.barrier(group=ctx.group)
        if destroy:
            dist.destroy_process_group()
            ctx.dist_backend = None


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def abandon_group() -> None:
    """Leave this process's default group after a failure, without the barrier shutdown() makes."""
    if dist.is_initialized():
        dist.destroy_process_group()
