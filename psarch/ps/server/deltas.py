"""GEO with train.compression: a pull answered with the compressed change of a partition since what the worker
holds, not the partition whole (compression both ways, as in DGC's and Qsparse-local-SGD's downlink).

The server keeps an fp32 copy of exactly what a worker holds of the partition (its GeoLocal.synced): set by a
whole pull (start-up), then moved by every delta sent, each added in fp32 as the worker adds it, so the two stay
equal bit for bit. A pull sends d = params - copy compressed as the pushes are: cast to fp16/bf16, or top-k's k
largest |d| as (int64 index, value) pairs in the wire dtype. What it leaves out (the cast's rounding, the elements
top-k did not pick) stays in params - copy and goes with a later pull: error feedback on the downlink.

Without the barrier each worker pulls at its own versions: one copy per worker, 4·N·Φ/k bytes on each of k
servers. With the barrier every worker pulls round r's model at version r (none can push round r + 1 before its
pull is answered) from the same start-up pull, so every worker holds the same model: one copy is kept, and round
r's delta is computed once, kept, and sent to every worker (4·Φ/k bytes a server, and the delta's wire bytes;
theory.dense).
"""
from __future__ import annotations

import torch

from psarch.ps.sparse import add_delta, largest

Delta = tuple[torch.Tensor | None, torch.Tensor]   # (int64 keys or None, values)


class NonFiniteDelta(ValueError):
    """A delta whose cast overflowed (fp16: beyond 65504); nothing was sent or changed."""


class WorkerCopies:
    """What the workers hold of one partition, and the compressed deltas that move it towards the parameters."""

    def __init__(self, params: torch.Tensor, workers: int, dtype: torch.dtype, ratio: float | None,
                 shared: bool) -> None:
        """dtype: what a delta's values travel in; ratio: top-k's (None: the whole delta, cast); shared: every
        worker holds the same model (GEO with the barrier): one copy, each version's delta computed once."""
        self.copies = params.detach().float().repeat(1 if shared else workers, 1)
        self.dtype, self.ratio, self.shared = dtype, ratio, shared
        self.sent: tuple[int, Delta] | None = None   # shared: the version whose delta was last computed, and it
        self.moved = False   # a delta was sent: the workers no longer hold what a whole pull would reset them to

    def held(self, worker: int) -> torch.Tensor:
        """The copy of what `worker` holds."""
        return self.copies[0 if self.shared else worker]

    def takes_whole(self) -> bool:
        """Whether a whole pull may set a worker's copy: always per worker; shared, only before any delta was sent
        (start-up, a fork), since one worker's whole pull would otherwise move the copy every other worker is
        judged by, and what their deltas left out would never be sent."""
        return not (self.shared and self.moved)

    def whole(self, worker: int, sent: torch.Tensor) -> None:
        """The worker was sent the partition whole (`sent`, in the wire dtype): it now holds exactly that."""
        assert self.takes_whole(), "a whole pull of a shared copy after a delta (PullQueue.on_pull refuses it)"
        self.held(worker).copy_(sent)
        self.sent = None

    def delta(self, worker: int, params: torch.Tensor, version: int) -> Delta:
        """(keys or None, values) of the worker's next delta (top-k: int64 keys and a (k, 1) tensor; a cast: the
        whole delta), its copy moved by it (shared: once per version); NonFiniteDelta, changing nothing, where the
        cast overflowed."""
        if self.shared and self.sent is not None and self.sent[0] == version:
            return self.sent[1]
        copy = self.held(worker)
        d = params.detach() - copy
        keys = largest(d, self.ratio) if self.ratio is not None else None
        values = (d if keys is None else d[keys]).to(self.dtype)
        if not bool(torch.isfinite(values).all()):
            raise NonFiniteDelta(f"a change of the parameters of up to {d.abs().max().item():.3g} does not fit "
                                 f"{str(self.dtype).removeprefix('torch.')}")
        add_delta(copy, keys, values)
        self.moved = True
        out = (None, values) if keys is None else (keys, values.view(-1, 1))
        if self.shared:
            self.sent = (version, out)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the copies and of the shared delta kept for the other workers (held from one round to the next)."""
        kept = [t for t in self.sent[1] if t is not None] if self.sent is not None else []
        return sum(t.numel() * t.element_size() for t in [self.copies, *kept])
