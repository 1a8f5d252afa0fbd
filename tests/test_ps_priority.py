"""ByteScheduler's priority (backend.priority_credit_mb; psarch/ps/worker/priority.py): pushes leave lowest
partition first within a credit per server, the next forward waits per module for its own partitions' pulls
(counted as communication), and the config rule that it needs pushes from backward's hooks."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from psarch.cluster.work_pacing import WorkClock
from psarch.config import from_dict
from psarch.errors import ConfigError
from psarch.ps.worker.client import Request
from psarch.ps.worker.link import Part
from psarch.ps.worker.priority import PriorityPushes, PullOrder
from ps_setup import config, ps

PARTS = 0.001   # MiB: 256 fp32 elements per partition


class _Link:
    """A ServerLink's face to PriorityPushes: partitions of 4 fp32 elements, pushes recorded, acks on demand."""

    def __init__(self, n: int, servers: int = 1) -> None:
        self.parts = [Part(j, j * servers // n, 4 * j, 4 * j + 4) for j in range(n)]
        self.flat = SimpleNamespace(grad=torch.zeros(4 * n))
        self.order: list[int] = []
        self.client = SimpleNamespace(take_arrived=lambda: None, wait=self.ack)

    def post_push(self, p: Part, pushed: torch.Tensor, step: int) -> Request:
        self.order.append(p.index)
        return Request({"op": "push", "step": step - 1, "offset": p.lo}, pushed[p.lo:p.hi])

    @staticmethod
    def ack(until: Request) -> None:
        until.answered = True


@pytest.mark.parametrize("credit, order", [(16, [7, 0, 1, 5, 6]), (10**6, [7, 6, 5, 1, 0])])
def test_priority_sends_the_lowest_partition_first_within_its_credit(credit, order):
    """Backward finishes partitions 7, 6, 5, then 1, 0: with one partition's bytes of credit, 7 goes at once and the
    rest wait, then leave lowest first as acks free the credit (0 and 1 overtake 5 and 6); with a credit larger
    than everything, each goes as backward finishes it (the order without priority)."""
    link = _Link(8)
    pushes = PriorityPushes(link, credit)
    pushes.arm(1)
    for j in (7, 6, 5, 1, 0):
        pushes.add(link.parts[j])
    pushes.flush()
    assert link.order == order and len(pushes.acks) == 5


class _Wire(_Link):
    """_Link whose pushes are each followed by their partition's pull (posted, as ServerLink.post_push does), and
    whose servers answer the oldest unanswered request first, one reply per wait(once=True)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.posted: list[Request | None] = [None] * n
        self.sent: list[Request] = []
        self.client = SimpleNamespace(take_arrived=lambda: None, wait=self.answer)

    def post_push(self, p: Part, pushed: torch.Tensor, step: int) -> Request:
        push = super().post_push(p, pushed, step)
        self.posted[p.index] = Request({"op": "pull", "step": step, "offset": p.lo})
        self.sent += [push, self.posted[p.index]]
        return push

    def answer(self, until: Request | None = None, once: bool = False) -> None:
        while True:
            oldest = next(r for r in self.sent if not r.answered)
            oldest.answered = True
            if once or until is None or until.answered:
                return


def test_priority_next_forward_posts_queued_pushes_while_it_waits():
    """After backward only what the credit allows is posted; the next forward's wait for partition 0 takes acks and
    posts the queued pushes lowest first until 0's pull is answered (0's ack frees the credit for 1 meanwhile), and
    goes on with 2 still queued (it leaves behind, at the latest when the exchange is settled). Before any exchange
    nothing is waited for."""
    link = _Wire(4)
    pushes = PriorityPushes(link, 16)
    pushes.wait_for(0)
    assert link.sent == []
    pushes.arm(1)
    for j in (3, 2, 1, 0):
        pushes.add(link.parts[j])
    pushes.pump()
    assert link.order == [3]
    pushes.wait_for(0)
    assert link.order == [3, 0, 1] and link.posted[0].answered and pushes.ready == [2]
    pushes.flush()
    assert link.order == [3, 0, 1, 2]


def test_priority_credit_is_per_server():
    """Partitions 0-3 on server 0, 4-7 on server 1 (contiguous ranges): with one partition of credit each server has
    one push in flight, so server 1 is not left idle while server 0 takes every worker's pushes in turn."""
    link = _Link(8, servers=2)
    pushes = PriorityPushes(link, 16)
    pushes.arm(1)
    for j in (7, 6, 5, 3, 2, 1, 0):
        pushes.add(link.parts[j])
    assert link.order == [7, 3]   # one in flight on each server before any ack
    pushes.flush()
    assert link.order == [7, 3, 5, 0, 6, 1, 2]   # acks in the order sent; each server lowest first


def test_priority_needs_pushes_from_backwards_hooks():
    for backend, train in (({"mode": "geo"}, {}), ({"overlap_comm": False}, {}), ({}, {"precision": "fp16"})):
        with pytest.raises(ConfigError, match="backend.priority_credit_mb = 0.25 orders the pushes"):
            from_dict(config("p", train=train, backend=ps(2, partition_mb=PARTS, priority_credit_mb=0.25, **backend)))
    from_dict(config("p", backend=ps(2, "ssp", partition_mb=PARTS, priority_credit_mb=0.25)))


def test_priority_forward_waits_for_pulls_count_as_communication():
    """A module's wait for its partitions' pulls (PullOrder's forward pre-hooks) is counted each step
    (waited_s, which the trainer takes into comm_s) and in total (total_s, which a virtual device's clock reads
    as the trainer's comm_waited_s, so that it is not counted as compute)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    landed: list[int] = []
    link = SimpleNamespace(parts=[Part(0, 0, 0, 20), Part(1, 0, 20, 25)],
                           landed=lambda j: (landed.append(j), time.sleep(0.02)))
    params = list(model.parameters())
    offsets = {id(p): o for p, o in zip(params, [0, 16, 20, 24])}
    order = PullOrder(model, link, offsets)
    model(torch.zeros(1, 4))
    assert landed == [0, 1] and 0.04 <= order.waited_s == order.total_s
    order.waited_s = 0.0   # the trainer takes a step's waits
    model(torch.zeros(1, 4))
    assert order.waited_s >= 0.04 and order.total_s >= 0.08 and order.total_s > order.waited_s


def test_priority_paced_work_inside_a_forward_wait_is_not_counted_as_the_wait():
    """A forward pre-hook's wait may compress a push (top-k's selection, paced by the virtual device's WorkClock,
    which counts its own time as work): that time is the clock's, not communication's, so a virtual device does
    not move its deadlines by it twice."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    clock = WorkClock(0.0, 1000.0, 1.0)   # 20 bytes of work: 20 ms

    def wait_for(j: int) -> None:
        with clock.work(0.0, 20.0):
            pass
        time.sleep(0.01)   # and then 10 ms waiting for the pull
    link = SimpleNamespace(parts=[Part(0, 0, 0, 20), Part(1, 0, 20, 25)], landed=lambda j: None)
    offsets = {id(p): o for p, o in zip(model.parameters(), [0, 16, 20, 24])}
    order = PullOrder(model, link, offsets, SimpleNamespace(wait_for=wait_for))
    order.clock = clock
    model(torch.zeros(1, 4))
    assert clock.spent_s >= 0.04 and 0.02 <= order.total_s < clock.spent_s, (order.total_s, clock.spent_s)
