"""The Trainer contract every backend implements, the Services protocol of processes beside the workers,
and the records they return."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from psarch import registry
from psarch.records import MemoryFigures, ServiceInfo, StepRecord, Summary, TrafficFigures

if TYPE_CHECKING:
    from pathlib import Path

    from psarch.checkpoint import Checkpoint, Pieces
    from psarch.cluster.work_pacing import WorkClock
    from psarch.config import Config
    from psarch.dist import DistContext
    from psarch.workload import Workload


@dataclass
class StepStats:
    """What one worker's step produced."""

    loss: float                      # mean loss over this worker's shard of the global batch
    skipped: bool = False            # fp16: inf/nan gradients, the update was skipped
    loss_scale: float | None = None  # fp16 loss scale after this step
    comm_s: float = 0.0              # time spent blocked on communication, where the backend can tell
    extra: dict[str, float] = field(default_factory=dict)   # the backend's own figures of the step


@dataclass
class MemoryReport:
    """Model-state bytes one rank holds, by category, from the tensors themselves."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0               # optimizer state, fp32 master weights included
    buffers: int = 0                 # communication buffers / padding beyond the three categories
    frozen: int = 0                  # parameters that do not train (train.trainable, LoRA's base weights)
    working: int = 0                 # peak of all transient buffers together (outside total)
    gathered_peak: int = 0           # peak of gathered parameters alone (ZeRO-3 units), part of working
    grad_buffer_peak: int = 0        # peak of transient gradient buffers alone (buckets, unit grads), part of working
    peak: int | None = None          # peak device memory (CUDA) or peak RSS (CPU), in bytes
    peak_kind: str | None = None     # "cuda_max_allocated" or "rss"
    padding: int = 0                 # bytes of the categories above that are padding
    error_feedback: int = 0          # bytes of buffers kept by gradient compression (error feedback, PowerSGD's P, Q)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers + self.frozen

    def to_dict(self) -> MemoryFigures:
        d = asdict(self)
        d["total"] = self.total
        return cast(MemoryFigures, d)


@dataclass
class OpTraffic:
    sent: int = 0
    received: int = 0
    calls: int = 0


@dataclass
class TrafficReport:
    """Bytes sent and received by one rank, by operation; `modelled` when not seen on the wire."""

    ops: dict[str, OpTraffic] = field(default_factory=dict)
    modelled: bool = False

    @property
    def sent(self) -> int:
        return sum(o.sent for o in self.ops.values())

    @property
    def received(self) -> int:
        return sum(o.received for o in self.ops.values())

    def to_dict(self) -> TrafficFigures:
        return {
            "sent": self.sent,
            "received": self.received,
            "modelled": self.modelled,
            "ops": {k: {"sent": v.sent, "received": v.received, "calls": v.calls} for k, v in self.ops.items()},
        }


class Services(Protocol):
    """Processes a backend runs beside its workers (the parameter servers), started by the launcher first
    (BackendSpec.start_services). Implementations name this protocol."""

    info: ServiceInfo                # what every rank needs to reach them

    def check(self) -> None:
        """Raise if a service failed."""

    def worker_lost(self, rank: int, error: str) -> None:
        """A worker died in a mode that goes on without it."""

    def pid(self, index: int) -> int | None:
        """The process id of service `index` (where [faults] strike it); None where this launcher started none."""

    def finish(self) -> Summary:
        """Their measurements, merged into summary.json."""

    def stop(self) -> None:
        """End every service (also after a failure)."""


def load_trainer(kind: str) -> type["Trainer"]:
    """The Trainer class of `backend.kind = kind` (its spec's `trainer`, imported now), refused unless it
    implements the whole contract."""
    spec = registry.spec(kind)
    module, _, name = spec.trainer.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise RuntimeError(f"backend.kind = {kind!r}: its implementation ({spec.trainer}) is not available: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise RuntimeError(f"backend.kind = {kind!r}: {spec.trainer} does not subclass psarch.trainer.Trainer")
    if cls.__abstractmethods__:
        raise RuntimeError(f"backend.kind = {kind!r}: {spec.trainer} does not implement "
                           f"{', '.join(sorted(cls.__abstractmethods__))} (psarch.trainer.Trainer)")
    return cls


class Trainer(ABC):
    """One worker of a backend; the runner drives every backend through these methods. What the launcher
    needs to know of a backend before any rank starts (process group, services, checkpoints) its spec
    declares (psarch/backend.py). A backend that leaves an abstract method out fails when its spec loads it."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        """Every backend's trainer is built from these three (the runner calls load_trainer's class so)."""

    @abstractmethod
    def step(self, batch: Any) -> StepStats:
        """Forward, backward, synchronise, update; the loss of this worker's shard."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated fp32 model state on rank 0 ({} elsewhere); may be a collective call."""

    @abstractmethod
    def memory(self) -> MemoryReport:
        """Model-state bytes this rank holds, by category, from the tensors themselves."""

    @abstractmethod
    def traffic(self) -> TrafficReport:
        """Bytes sent and received so far, by operation."""

    # Checkpoints (psarch.checkpoint), by parameter name and flat offset, not by the backend's layout.
    @abstractmethod
    def checkpoint_pieces(self, writing: bool = True) -> "Pieces":
        """The fragments this rank writes (writing=True; replicated state is split among ranks) or holds."""

    @abstractmethod
    def load_checkpoint(self, ckpt: "Checkpoint") -> None:
        """Fill what this rank holds from any checkpoint (any backend's, any world size)."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets, hooks and threads."""

    def next_step(self, step: int) -> int:
        """The step this rank takes after `step`: the next, unless the backend moved it on (a ps sync worker dropped
        from rounds that went on without it takes the round it was re-admitted at)."""
        return step + 1

    def write_checkpoint(self, ctx: Any, root: "Path", step: int, config: dict[str, Any], keep: int,
                         steps: list[StepRecord] | None) -> "Path":
        """Write checkpoint `step` under `root` (every rank calls it after the same step), with this rank's
        step records so far: by default checkpoint_pieces() through psarch.checkpoint.save over the ranks'
        process group."""
        from psarch.checkpoint import save
        return save(self.checkpoint_pieces(), ctx, root, step, config, keep, steps, self.save_services)

    def save_services(self, step: int, folder: "Path") -> list[str]:
        """The services' parts of checkpoint `step`, written into `folder` (EmbeddingTables.save_services: the
        hybrid's PS servers); none by default."""
        return []

    def summary_extra(self) -> dict[str, Any]:
        """Backend-specific figures for summary.json's `extra` (one list entry per rank)."""
        return {}

    def pace_work(self, clock: WorkClock) -> None:
        """Pace the backend's own work beside forward and backward (a gradient compression's) on a virtual device's
        clock (psarch/cluster/work_pacing.py): each piece run inside clock.work(its FLOPs, its bytes); none by
        default."""

    def comm_waited_s(self) -> float:
        """Seconds this rank has blocked on communication so far, where it blocks inside forward or backward
        (ZeRO's gathers and hook reductions; 0 where a backend waits only after backward). A straggler
        takes the difference over its forward and backward, so the compute it scales holds no wait."""
        return 0.0


def consolidated_state(model: torch.nn.Module, masters: dict[int, torch.Tensor], copy: bool = True
                       ) -> dict[str, torch.Tensor]:
    """The model's state_dict in fp32 on the CPU, taking each parameter from its fp32 master where given
    (under every name of a tied weight). With copy=False the given masters are already fp32 CPU copies
    made for this (ZeRO's gathered export) and are used as they are, so rank 0 holds its output once."""
    out = {}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    for name, value in model.state_dict().items():
        p = by_name.get(name)
        src = masters.get(id(p), value) if p is not None else value
        if not copy and src is not value:
            out[name] = src.view(value.shape)
            continue
        dtype = torch.float32 if src.is_floating_point() else src.dtype
        out[name] = src.detach().reshape(value.shape).to("cpu", dtype, copy=True)
    return out
