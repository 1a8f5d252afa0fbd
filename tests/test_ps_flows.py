"""The sync PS's steps as flows (psarch/ps/program.py's program, played in steady state by psarch/theory/steady.py,
which replaced psarch/ps/flows.py): steps by hand where push-then-pull holds, the colocated collision where it
does not, and an emulated run's prediction through it."""
from __future__ import annotations

import pytest

from psarch.config import from_dict
from psarch.ps.program import Slot, ps_program
from psarch.theory.program import Cluster, DataStep
from psarch.theory.steady import steady_step

S = 1e6        # bytes of the flat vector
RATE = 1e7     # bytes/s of every link


def step_time(n: int, servers: list[list[Slot]], colocated: bool, compute: float, backward: float) -> float:
    p = ps_program(n, servers, colocated, DataStep(compute - backward, backward))
    return steady_step(p, Cluster.of(p, RATE)).step_s


def two_ranges(k: int = 2) -> list[list[Slot]]:
    """k servers' contiguous ranges of S bytes, each ready when backward reaches its first element."""
    return [[Slot(S / k, 1 - j / k)] for j in range(k)]


def test_steps_by_hand_where_push_then_pull_holds():
    """Everything ready at backward's end (backward_s = 0): a colocated pair pushes S/2 each way, then pulls
    S/2 each way; one dedicated server takes both workers' S, then sends it back: 2 S each way."""
    compute = 0.05
    assert step_time(2, two_ranges(), True, compute, 0.0) == pytest.approx(compute + S / RATE)
    assert step_time(2, [[Slot(S, 1.0)]], False, compute, 0.0) == pytest.approx(compute + 4 * S / RATE)
    # one worker beside its one server: nothing crosses a link
    assert step_time(1, [[Slot(S, 1.0)]], True, compute, 0.0) == pytest.approx(compute)


def test_colocated_ranges_pushed_from_backward_collide():
    """Pushed from backward's hooks, a colocated pair is slower than pushed after it: range 1, ready mid-backward,
    is pulled from node 1 while worker 1 pushes range 0 the same way, and range 0's pulls wait for that push.
    Dedicated servers have a direction each for pushes and pulls: the hooks only help them. (As measured at
    N = 2, 100 Mbit/s: S/2 takes longer than backward.)"""
    compute, backward = 0.25, 0.166
    scale = S / RATE / 0.5   # as on links that carry S in 0.5 s: the times scaled to these links
    colocated = [step_time(2, two_ranges(), True, compute * scale, b * scale) for b in (0.0, backward)]
    assert colocated[1] > colocated[0] * 1.1
    dedicated = [step_time(2, two_ranges(), False, compute * scale, b * scale) for b in (0.0, backward)]
    assert dedicated[1] <= dedicated[0] + 1e-12


def test_an_emulated_runs_prediction_is_the_steady_step_of_its_program():
    """cluster_step of a sync PS with whole ranges pushed from the hooks to colocated servers: the steady step of
    the spec's program on the run's links, α paid per message inside it."""
    from psarch import registry
    from psarch.theory import WIRE_OVERHEAD, cluster_step

    phi = 250_000
    cfg = from_dict({"backend": {"kind": "ps", "world_size": 4, "servers": 4, "partition_mb": 0.0,
                                 "server_placement": "colocated"},
                     "train": {"optimizer": "sgd", "global_batch": 8},
                     "cluster": {"emulate": True, "link_mbps": 100.0}})
    summary = {"params": phi, "step_time_s": 0.2, "comm_s": 0.15, "extra": {}, "cluster": {"alpha_s": 1e-4}}
    p = registry.spec_of(cfg).program(cfg, phi, DataStep.of(0.05), False)
    want = steady_step(p, Cluster.of(p, 100e6 / 8 / WIRE_OVERHEAD, 1e-4)).step_s
    assert cluster_step(cfg, summary)["predicted_s"] == pytest.approx(want)
    assert want > 0.05 + 2 * 3 / 4 * phi * 4 / (100e6 / 8)   # at least its bytes at the link's rate
