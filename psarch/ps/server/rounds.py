"""A barrier round's sum (sync, GEO with the barrier), added in worker order whatever order the pushes arrive in.

fp32 addition is not associative: summed in arrival order, the last bits of a round from N = 3 on depend on
which worker was slowest, so two runs of one config, or a run and its resume, would differ. Here the sum goes
0, 1, 2, ... over the workers in the round: a push that arrives before a predecessor's is kept as a copy
until the gap fills, and a worker lost without pushing leaves no gap (the round completes over the live
workers). Memory: besides the accumulator, up to N - 1 kept pushes of the range in the wire dtype at worst
(worker 0 last), none at a round's end; `peak` records the most bytes kept. A top-k push (Pairs) is summed
sparsely: its k values are added at their indices (O(k)), and kept, if early, as its k pairs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Pairs:
    """A top-k push of one partition: distinct indices within it and their values."""

    keys: torch.Tensor      # int64
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def dense(self, out: torch.Tensor) -> torch.Tensor:
        """The partition's gradient: the values at their indices, zero elsewhere, in `out` (of its own dtype: a
        bf16 run's values into an fp32 accumulator, as a dense push is added)."""
        return out.zero_().index_put_((self.keys,), self.values.to(out.dtype))


class OrderedSum:
    """Which pushes of the current round are summed into the accumulator, and which are kept until their turn."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.summed: set[int] = set()                # added to the accumulator, in worker order
        self.early: dict[int, torch.Tensor | Pairs] = {}   # arrived before a predecessor's: copies, until their turn
        self.peak = 0                                # the most bytes ever kept in `early`

    def next(self, live: set[int], pushed: set[int]) -> int | None:
        """The worker whose push the sum takes next: the first not yet summed that is live or has pushed."""
        return next((v for v in range(self.workers) if v not in self.summed and (v in live or v in pushed)), None)

    def destination(self, w: int, live: set[int], pushed: set[int], acc: torch.Tensor,
                    scratch: torch.Tensor) -> torch.Tensor:
        """Where to decode worker w's push: the accumulator (its turn, the round's first, same dtype), the
        scratch buffer (its turn), or a fresh copy (early; kept only once every check has passed)."""
        if w != self.next(live, pushed):
            return torch.empty_like(scratch)
        return acc if not self.summed and acc.dtype == scratch.dtype else scratch

    def add(self, w: int, data: torch.Tensor | Pairs, acc: torch.Tensor, live: set[int], pushed: set[int]) -> None:
        """Worker w's checked push (`pushed` not yet holding w): summed if it is its turn, else kept."""
        if w == self.next(live, pushed):
            self._sum(w, data, acc)
        else:
            self.keep(w, data)

    def keep(self, w: int, data: torch.Tensor | Pairs) -> None:
        """Keep worker w's checked push unsummed (a replica's round, summed once its first holder says which pushes
        it sums: psarch/ps/replication.py)."""
        self.early[w] = data
        self.peak = max(self.peak, sum(t.nbytes for t in self.early.values()))

    def drop(self, workers: set[int]) -> None:
        """Forget the kept pushes of `workers` (a replica's round that its first holder summed without them)."""
        for w in workers:
            self.early.pop(w, None)

    def drain(self, acc: torch.Tensor, live: set[int], pushed: set[int]) -> None:
        """Sum the kept pushes whose predecessors are all in (or lost without pushing), in worker order."""
        while (v := self.next(live, pushed)) in self.early:
            self._sum(v, self.early.pop(v), acc)

    def complete(self, members: set[int] | frozenset[int]) -> bool:
        """Whether the round's sum holds exactly the pushes of `members` (after `drain`, once every live worker
        pushed: every push of the round; a replica's: those its first holder summed)."""
        return not self.early and self.summed == members

    def clear(self) -> None:
        self.summed.clear()

    def _sum(self, w: int, data: torch.Tensor | Pairs, acc: torch.Tensor) -> None:
        if isinstance(data, Pairs):   # the same sums as adding the dense push: x + 0 = x elsewhere
            if not self.summed:
                data.dense(acc)
            else:
                acc.index_add_(0, data.keys, data.values.to(acc.dtype))
        elif not self.summed:   # the round's first overwrites the accumulator
            if data is not acc:
                acc.copy_(data)
        else:
            acc.add_(data)
        self.summed.add(w)
