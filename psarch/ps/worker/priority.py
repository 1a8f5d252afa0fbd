"""Priority (ByteScheduler, Peng et al., SOSP '19; `backend.priority_credit_mb` > 0): the parameters the next
forward needs first go first.

Pushes started from backward's hooks (schedule.py) wait in a queue ordered by partition (the flat vector is in
registration order, forward order) and leave with at most `credit` bytes of pushes unacknowledged per server: a
push is acknowledged when its server has it (not when its round completes, which waits on the other workers: a
credit tied to other workers could deadlock them), so a partition the next forward needs early overtakes those
backward finished before it, once the credit in flight drains. The credit is per server because a server owns a
contiguous range: one credit for all would send every worker's pushes to server 0 first, then to server 1, each
server's link in turn carrying all N workers' pushes while the others idle. Each push is followed by its partition's pull.
After backward the worker posts what the credit allows and goes on: the next forward waits per module
(`PullOrder`, forward pre-hooks) only for the partitions holding that module's own parameters, posting the
queued pushes as acks free the credit while it waits, and the later partitions still go out and come back
behind it, as ByteScheduler's scheduler thread sends them. (Posting every push before the next forward, as
psarch did first, held that forward until all but the last credit's worth had left: priority then measured no
gain at any credit.)
"""
from __future__ import annotations

import bisect
import heapq
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from psarch.ps.worker.client import Request
from psarch.ps.worker.link import Part, ServerLink

if TYPE_CHECKING:
    from psarch.cluster.work_pacing import WorkClock


class PriorityPushes:
    """Partitions ready to push, posted lowest index first with at most `credit` bytes unacknowledged per server."""

    def __init__(self, link: ServerLink, credit: int) -> None:
        self.link, self.credit = link, credit
        self.ready: list[int] = []             # heap of partition indices
        self.acks: list[Request] = []          # this exchange's pushes (their acks carry staleness)
        self.servers: list[int] = []           # the server of each push in `acks`
        self.step = 0

    def arm(self, step: int) -> None:
        """The next backward's pushes are for `step` (their pulls ask for the parameters of step + 1)."""
        self.ready, self.acks, self.servers, self.step = [], [], [], step

    def add(self, part: Part) -> None:
        """From a hook: partition `part` is final; post what the credit allows (taking the acks already here)."""
        heapq.heappush(self.ready, part.index)
        self.link.client.take_arrived()
        self.pump()

    def flush(self) -> None:
        """Post every partition still queued, waiting for acks as the credit needs (before the exchange is
        settled)."""
        while self.ready:
            needed = {self.link.parts[j].server for j in self.ready}
            oldest = next(r for r, i in zip(self.acks, self.servers) if i in needed and not r.answered)
            self.link.client.wait(until=oldest)
            self.pump()

    def wait_for(self, j: int) -> None:
        """The next forward needs partition j: take replies, posting queued pushes as acks free the credit, until
        j's pull is posted and answered (nothing to wait for where no exchange holds j)."""
        client = self.link.client
        client.take_arrived()
        self.pump()
        while j in self.ready or not ((posted := self.link.posted[j]) is None or posted.answered):
            client.wait(once=True)
            self.pump()

    def pump(self) -> None:
        """Post the queued partitions the credit allows, lowest first."""
        flight: dict[int, int] = {}
        for r, i in zip(self.acks, self.servers):
            if not r.answered:
                flight[i] = flight.get(i, 0) + r.nbytes
        held = []
        while self.ready:
            j = heapq.heappop(self.ready)
            p = self.link.parts[j]
            if flight.get(p.server, 0) and flight[p.server] >= self.credit:
                held.append(j)
                continue
            push = self.link.post_push(p, self.link.flat.grad, self.step)
            self.acks.append(push)
            self.servers.append(p.server)
            flight[p.server] = flight.get(p.server, 0) + push.nbytes
        for j in held:
            heapq.heappush(self.ready, j)


class PullOrder:
    """Forward pre-hooks: a module waits for the pulls of the partitions holding its own parameters (with
    `pushes`, posting the queued pushes while it waits)."""

    def __init__(self, model: torch.nn.Module, link: ServerLink, offsets: dict[int, int],
                 pushes: PriorityPushes | None = None) -> None:
        self.link, self.pushes, self.waited_s = link, pushes, 0.0   # waited_s: this step's (the trainer takes it)
        self.total_s = 0.0                     # every wait so far (a virtual device's clock reads it live)
        self.clock: WorkClock | None = None    # a virtual device's: its paced work inside a wait is not the wait's
        starts = [p.lo for p in link.parts]
        self.hooks = []
        for module in model.modules():
            covers = sorted({j for q in module.parameters(recurse=False) if id(q) in offsets
                             for j in _covering(starts, offsets[id(q)], q.numel())})
            if covers:
                self.hooks.append(module.register_forward_pre_hook(self._hook(covers)))

    def _hook(self, covers: list[int]) -> Any:
        def before_forward(module: torch.nn.Module, args: Any) -> None:
            t0, worked = time.perf_counter(), self.clock.spent_s if self.clock is not None else 0.0
            for j in covers:
                if self.pushes is not None:
                    self.pushes.wait_for(j)   # may compress a push here (top-k): work the clock counts itself
                self.link.landed(j)
            dt = time.perf_counter() - t0 - (self.clock.spent_s - worked if self.clock is not None else 0.0)
            self.waited_s += dt
            self.total_s += dt
        return before_forward

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _covering(starts: Sequence[int], offset: int, numel: int) -> range:
    """The partitions (by index; `starts` their first elements) that elements [offset, offset + numel) fall in."""
    return range(bisect.bisect_right(starts, offset) - 1, bisect.bisect_right(starts, offset + numel - 1))
