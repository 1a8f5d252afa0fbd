"""What theory predicts: model-state memory per rank (ZeRO paper, Rajbhandari et al. 2020) and the
bytes each algorithm moves per step. Used beside every measured figure, and by `psarch estimate`."""
from __future__ import annotations

from dataclasses import dataclass

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def optimizer_bytes_per_param(optimizer: str, precision: str, momentum: float = 0.0) -> int:
    """K in the ZeRO paper: optimizer state per parameter, fp32 master copy included where kept."""
    state = {"adamw": 8, "adagrad": 4}.get(optimizer, 4 if momentum > 0 else 0)
    return state + (0 if precision == "fp32" else 4)


@dataclass
class MemoryPrediction:
    params: float
    grads: float
    optimizer: float
    buffers: float = 0.0     # model state outside the three categories (a GEO worker's last synced copy)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.buffers

    def to_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "buffers": self.buffers, "total": self.total}


def memory_per_rank(kind: str, phi: float, n: int, precision: str = "fp32", optimizer: str = "adamw",
                    momentum: float = 0.0, stage: int = 0, mode: str = "sync") -> MemoryPrediction:
    """Model-state bytes per rank: single/ddp replicate everything; ZeRO stage s shards the first s of
    (optimizer, gradients, parameters) over n ranks; a PS worker holds parameters and gradients only,
    except in GEO mode, where it runs a local optimizer and keeps the last synced fp32 model for its delta."""
    b = BYTES[precision]
    k = optimizer_bytes_per_param(optimizer, precision, momentum)
    kind, stage = {"torch_zero": ("zero", 1), "torch_fsdp": ("zero", 3)}.get(kind, (kind, stage))
    if kind == "zero":
        return MemoryPrediction(params=b * phi / n if stage >= 3 else b * phi,
                                grads=b * phi / n if stage >= 2 else b * phi,
                                optimizer=k * phi / n)
    if kind == "ps" and mode == "geo":
        return MemoryPrediction(params=b * phi, grads=b * phi, optimizer=k * phi, buffers=4 * phi)
    if kind == "ps":
        return MemoryPrediction(params=b * phi, grads=b * phi, optimizer=0.0)
    return MemoryPrediction(params=b * phi, grads=b * phi, optimizer=k * phi)


def ps_server_memory(phi: float, servers: int, optimizer: str = "adamw", momentum: float = 0.0) -> float:
    """Bytes one PS server holds: its fp32 parameter range plus the optimizer state for it."""
    return (4 + optimizer_bytes_per_param(optimizer, "fp32", momentum)) * phi / servers


def traffic_per_step(kind: str, payload_bytes: float, n: int, stage: int = 0, servers: int = 1) -> dict[str, float]:
    """Bytes one worker sends (= receives) per step, and for the PS what each server receives (= sends).

    payload_bytes is S: the gradients' (or parameters') size in the wire dtype."""
    s = payload_bytes
    # torch's ZeroRedundancyOptimizer sits on DDP: a full all-reduce, then each rank broadcasts its
    # updated shard (an all-gather's volume): 3(N-1)/N, unlike ZeRO-1's reduce-scatter + all-gather.
    kind, stage = {"torch_zero": ("zero", 3), "torch_fsdp": ("zero", 3), "torch_ddp": ("ddp", 0)}.get(kind, (kind, stage))
    if kind in ("single",) or n == 1 and kind != "ps":
        return {"worker_sent": 0.0, "worker_received": 0.0}
    if kind == "ddp":
        v = 2 * (n - 1) / n * s
    elif kind == "zero":
        v = (3 if stage == 3 else 2) * (n - 1) / n * s
    elif kind == "ps":
        return {"worker_sent": s, "worker_received": s, "server_received": n * s / servers,
                "server_sent": n * s / servers}
    else:
        raise ValueError(f"unknown backend kind {kind!r}")
    return {"worker_sent": v, "worker_received": v}
