"""GEO with train.compression: a pull answered with the compressed change of a partition since what the worker
holds, not the partition whole (compression both ways, as in DGC's and Qsparse-local-SGD's downlink).

The server keeps, per worker, an fp32 copy of exactly what that worker holds of the partition (its GeoLocal.synced):
set by a whole pull (start-up), then moved by every delta sent, each added in fp32 as the worker adds it, so the
two stay equal bit for bit. A pull sends d = params - copy compressed as the pushes are: cast to fp16/bf16, or
top-k's k largest |d| as (int64 index, value) pairs in the wire dtype. What it leaves out (the cast's rounding,
the elements top-k did not pick) stays in params - copy and goes with a later pull: error feedback on the
downlink. Memory: N fp32 copies of each partition, 4·N·Φ/k bytes on each of k servers (theory.dense).
"""
from __future__ import annotations

import torch

from psarch.ps.sparse import add_delta, largest


class NonFiniteDelta(ValueError):
    """A delta whose cast overflowed (fp16: beyond 65504); nothing was sent or changed."""


class WorkerCopies:
    """What each worker holds of one partition, and the compressed deltas that move it towards the parameters."""

    def __init__(self, params: torch.Tensor, workers: int, dtype: torch.dtype, ratio: float | None) -> None:
        """dtype: what a delta's values travel in; ratio: top-k's (None: the whole delta, cast)."""
        self.copies = params.detach().float().repeat(workers, 1)
        self.dtype, self.ratio = dtype, ratio

    def whole(self, worker: int, sent: torch.Tensor) -> None:
        """The worker was sent the partition whole (`sent`, in the wire dtype): it now holds exactly that."""
        self.copies[worker].copy_(sent)

    def delta(self, worker: int, params: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(keys or None, values) of the worker's next delta (top-k: int64 keys and a (k, 1) tensor; a cast: the
        whole delta), its copy moved by it; NonFiniteDelta, changing nothing, where the cast overflowed."""
        copy = self.copies[worker]
        d = params.detach() - copy
        keys = largest(d, self.ratio) if self.ratio is not None else None
        values = (d if keys is None else d[keys]).to(self.dtype)
        if not bool(torch.isfinite(values).all()):
            raise NonFiniteDelta(f"a change of the parameters of up to {d.abs().max().item():.3g} does not fit "
                                 f"{str(self.dtype).removeprefix('torch.')}")
        add_delta(copy, keys, values)
        return (None, values) if keys is None else (keys, values.view(-1, 1))

    @property
    def nbytes(self) -> int:
        return self.copies.numel() * self.copies.element_size()
