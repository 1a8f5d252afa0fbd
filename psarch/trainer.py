"""The Trainer protocol every backend implements, and the records it returns."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from pathlib import Path

    from psarch.checkpoint import Checkpoint, Pieces


@dataclass
class StepStats:
    """What one worker's step produced."""

    loss: float                      # mean loss over this worker's shard of the global batch
    skipped: bool = False            # fp16: inf/nan gradients, the update was skipped
    loss_scale: float | None = None  # fp16 loss scale after this step
    comm_s: float = 0.0              # time spent blocked on communication, where the backend can tell
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class MemoryReport:
    """Model-state bytes one rank holds, by category, from the tensors themselves."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0               # optimizer state, fp32 master weights included
    buffers: int = 0                 # communication buffers / padding beyond the three categories
    working: int = 0                 # peak of all transient buffers together (outside total)
    gathered_peak: int = 0           # peak of gathered parameters alone (ZeRO-3 units), part of working
    grad_buffer_peak: int = 0        # peak of transient gradient buffers alone (buckets, unit grads), part of working
    peak: int | None = None          # peak device memory (CUDA) or peak RSS (CPU), in bytes
    peak_kind: str | None = None     # "cuda_max_allocated" or "rss"
    padding: int = 0                 # bytes of the categories above that are padding

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total"] = self.total
        return d


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "received": self.received,
            "modelled": self.modelled,
            "ops": {k: asdict(v) for k, v in self.ops.items()},
        }


class Services(Protocol):
    """Processes a backend runs beside its workers (the parameter servers), started by the launcher first."""

    info: dict[str, Any]             # what every rank needs to reach them (JSON-able: addresses)

    def check(self) -> None: ...                          # raise if a service failed
    def worker_lost(self, rank: int, error: str) -> None: ...  # a worker died in a mode that goes on without it
    def finish(self) -> dict[str, Any]: ...               # their measurements, merged into summary.json
    def stop(self) -> None: ...


@runtime_checkable
class Trainer(Protocol):
    """One worker of a backend; the runner drives every backend through these methods. A backend class
    subclasses Trainer to inherit the defaults of the members below that it does not override."""

    # Every rank steps in lockstep with a process group (the progress line averages loss across ranks).
    synchronous: ClassVar[bool] = True
    # The launcher creates a torch.distributed group for the ranks (a PS's workers must not share one:
    # a group hangs when one member dies, and async modes go on without a lost worker).
    needs_process_group: ClassVar[bool] = True
    # The backend writes and reads checkpoints (checkpoint_pieces / load_checkpoint below).
    checkpoints: ClassVar[bool] = False

    def step(self, batch: Any) -> StepStats: ...
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...
    def memory(self) -> MemoryReport: ...
    # Checkpoints (psarch.checkpoint), by parameter name and flat offset, not by the backend's layout:
    # the fragments this rank writes (writing=True; replicated state is split among ranks) or holds.
    def checkpoint_pieces(self, writing: bool = True) -> "Pieces": ...
    def load_checkpoint(self, ckpt: "Checkpoint") -> None: ...   # fill what this rank holds from any checkpoint

    def write_checkpoint(self, ctx: Any, root: "Path", step: int, config: dict[str, Any], keep: int,
                         rows: list[dict[str, Any]] | None) -> "Path":
        """Write checkpoint `step` under `root` (every rank calls it after the same step): by default
        checkpoint_pieces() through psarch.checkpoint.save over the ranks' process group."""
        from psarch.checkpoint import save
        return save(self.checkpoint_pieces(), ctx, root, step, config, keep, rows)
    def traffic(self) -> TrafficReport: ...
    def close(self) -> None: ...

    def summary_extra(self) -> dict[str, Any]:
        """Backend-specific figures for summary.json's `extra` (one list entry per rank)."""
        return {}

    def comm_waited_s(self) -> float:
        """Seconds this rank has blocked on communication so far, where it blocks inside forward or backward
        (ZeRO's gathers and hook reductions; 0 where a backend waits only after backward). A straggler
        takes the difference over its forward and backward, so the compute it scales holds no wait."""
        return 0.0

    @classmethod
    def start_services(cls, cfg: Any, out_dir: Any, where: Any = None, start: Any = None) -> Services | None:
        """Services to start before the workers (rank 0 under torchrun); None when the backend has none.
        `where` places each service (psarch.cluster; None: loopback); `start`: the checkpoint the run starts from."""
        return None

    @staticmethod
    def tolerates_lost_workers(cfg: Any) -> bool:
        """Whether the run goes on when a worker dies (the services are told, via Services.worker_lost)."""
        return False
