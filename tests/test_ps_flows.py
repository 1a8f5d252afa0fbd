"""The flow model of the sync PS's steps (psarch/ps/flows.py): max-min fair links by hand, steps by hand where
the phases hold, the colocated collision where they do not, and where the PS's theory uses it."""
from __future__ import annotations

import pytest

from psarch.config import from_dict
from psarch.ps.flows import Flow, Links, step_time

S = 1e6        # bytes of the flat vector
RATE = 1e7     # bytes/s of every link


def test_links_share_max_min_fairly():
    """Three flows into node 2 get a third of its downlink each; the flow beside one of them on node 0's uplink
    takes what that one leaves (2/3), not half."""
    links = Links([1.0] * 5, [1.0] * 5)
    a, b, c, d = (Flow(src, dst, 1.0, lambda now: None) for src, dst in ((0, 1), (0, 2), (3, 2), (4, 2)))
    for i, f in enumerate((a, b, c, d)):
        links.send(i, f)
    rate = links.rates(links.active())
    assert rate[id(a)] == pytest.approx(2 / 3)
    assert [rate[id(f)] for f in (b, c, d)] == pytest.approx([1 / 3] * 3)


def test_one_connection_carries_one_flow_at_a_time():
    links = Links([1.0] * 2, [1.0] * 2)
    first, second = Flow(0, 1, 1.0, lambda now: None), Flow(0, 1, 1.0, lambda now: None)
    links.send("w0->s1", first)
    links.send("w0->s1", second)
    assert links.active() == [first]


def two_ranges(n: int = 2) -> list[tuple[int, int, float]]:
    """n servers' contiguous ranges of a 1000-element vector of S bytes: (lo, server, bytes)."""
    return [(j * 1000 // n, j, S / n) for j in range(n)]


def test_steps_by_hand_where_push_then_pull_holds():
    """Everything ready at backward's end (backward_s = 0): a colocated pair pushes S/2 each way, then pulls
    S/2 each way; one dedicated server (node 2) takes both workers' S, then sends it back: 2 S each way."""
    compute = 0.05
    assert step_time(2, [0, 1], two_ranges(), 1000, compute, 0.0, [RATE] * 2, [RATE] * 2) == pytest.approx(
        compute + S / RATE)
    assert step_time(2, [2], [(0, 0, S)], 1000, compute, 0.0, [RATE] * 3, [RATE] * 3) == pytest.approx(
        compute + 4 * S / RATE)
    # one worker beside its one server: nothing crosses a link
    assert step_time(1, [0], [(0, 0, S)], 1000, compute, 0.0, [RATE], [RATE]) == pytest.approx(compute)


def test_colocated_ranges_pushed_from_backward_collide():
    """Pushed from backward's hooks, a colocated pair is slower than pushed after it: range 1, ready mid-backward,
    is pulled from node 1 while worker 1 pushes range 0 the same way, and range 0's pulls wait for that push.
    Dedicated servers have a direction each for pushes and pulls: the hooks only help them. (As measured at
    N = 2, 100 Mbit/s: S/2 takes longer than backward.)"""
    compute, backward, rate = 0.25, 0.166, S / 0.5
    colocated = [step_time(2, [0, 1], two_ranges(), 1000, compute, b, [rate] * 2, [rate] * 2) for b in (0.0, backward)]
    assert colocated[1] > colocated[0] * 1.1
    dedicated = [step_time(2, [2, 3], two_ranges(), 1000, compute, b, [rate] * 4, [rate] * 4) for b in (0.0, backward)]
    assert dedicated[1] <= dedicated[0] + 1e-12


def ps(**backend) -> object:
    return from_dict({"backend": {"kind": "ps", "world_size": 4, "servers": 4, "partition_mb": 0.0,
                                  "server_placement": "colocated", **backend},
                      "train": {"optimizer": "sgd", "global_batch": 8}})


def test_the_ps_replays_colocated_whole_ranges_only():
    """The PS's comm model replays sync whole ranges pushed from the hooks to colocated servers, and the
    cluster's step time is that replay plus α per message; partitions, dedicated servers, async and pushes
    after backward keep the closed form."""
    from psarch import registry
    from psarch.ps import theory
    from psarch.theory import WIRE_OVERHEAD, cluster_step_time, predict
    phi = 250_000

    def model(cfg):
        return registry.spec_of(cfg).comm_model(cfg, phi, {})

    cfg = ps()
    m = model(cfg)
    assert m.replay is not None
    rate = 100e6 / 8 / WIRE_OVERHEAD
    ranges = [(p[0][0], j, (p[0][1] - p[0][0]) * 4) for j, p in enumerate(theory.dense_partitions(cfg, phi))]
    alone = step_time(4, [0, 1, 2, 3], ranges, phi, 0.05, 0.03, [rate] * 4, [rate] * 4)
    got = cluster_step_time(predict(cfg, phi), 0.05, 100.0, 100.0, 1e-4, m, backward_s=0.03)["step_time_s"]
    assert got == pytest.approx(alone + predict(cfg, phi).messages * 1e-4)
    for other in (ps(partition_mb=0.1), ps(server_placement="dedicated"), ps(mode="async"), ps(overlap_comm=False)):
        assert model(other).replay is None
