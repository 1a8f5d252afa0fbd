"""Chain replication (backend.replicas = r) when a worker is lost or paused: every holder of a partition drops a
lost worker from the same round (its followers sum what its first holder summed), and takes a paused worker that
returns back at the same round; tiny GPT runs on loopback, against the r = 0 run with the same fault. The servers'
faults: test_replication.py."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import psarch
from ps_setup import TINY_GPT, config, ps
from psarch.config import from_dict
from psarch.ps.worker.client import PSClient
from psarch.workload import build_workload
from test_faults import _slowest_step
from test_ps_faults import _children
from test_replication import _same
from test_replication_chain import SGD, _cfg
from timing import scaled


def dies_between_its_sends(cfg) -> psarch.Workload:
    """A tiny GPT whose worker 2 dies as it sends step 3's pushes: the first to reach a server (the copy for a
    partition's replica, sent first) arrives; the next (the same partition's, to its primary) is never sent."""
    sent = []
    post = PSClient.post

    def post_then_die(self, i, r):
        if self.worker == 2 and r.header["op"] == "pushpull" and r.header["step"] == 3:
            if sent:
                time.sleep(0.5)   # ZeroMQ sends the first push meanwhile
                os._exit(3)
            sent.append(i)
        post(self, i, r)
    PSClient.post = post_then_die
    return build_workload(from_dict(dict(TINY_GPT, train=cfg.to_dict()["train"])))


KILLED_AT_3 = ps(3, servers=2, timeout_s=scaled(2.0))   # each run waits it out once: the lost worker's drop


@pytest.fixture(scope="module")
def r0_killed_at_3(tmp_path_factory) -> Path:
    """The r = 0 run whose worker 2 of 3 is killed as step 3 begins: rounds 3 to 7 are workers 0 and 1's."""
    out = tmp_path_factory.mktemp("r0") / "r0"
    psarch.run(_cfg("r0", KILLED_AT_3, {"kill": [{"node": "worker 2", "step": 3}]}), out, echo=False)
    return out


@pytest.mark.parametrize("how", ["killed", "dies between its sends"])
def test_a_worker_lost_mid_run_is_dropped_from_the_same_round_by_every_holder(tmp_path, r0_killed_at_3, how):
    """Worker 2 of 3 with r = 1, lost at step 3: killed as the step begins; or dead as it sends step 3's pushes,
    after one of them reached a replica (the partition's primary never had it and sums round 3 over workers 0 and
    1; the replica, which has the dead worker's push, sums the same, as the survivors' `commit` says, and drops
    it). Each run finishes, its copies bit for bit equal, with the model of the r = 0 run whose worker 2 is killed
    as step 3 begins (rounds 3 to 7 are workers 0 and 1's in both; SGD with momentum)."""
    backend = dict(KILLED_AT_3, replicas=1)
    fault = {"killed": {"kill": [{"node": "worker 2", "step": 3}]}, "dies between its sends": {}}[how]
    dies = {"workload": {"factory": "test_replication_workers:dies_between_its_sends"}}
    extra = dies if how == "dies between its sends" else {}
    cfg = from_dict(config("r1", train=SGD, backend=backend, faults=fault, **extra))
    summary = psarch.run(cfg, tmp_path / "r1", echo=False)
    assert _children() == []
    assert summary["status"] == "finished" and summary["steps"] == 8
    assert [w["rank"] for w in summary["lost_workers"]] == [2]
    assert summary["replication"]["copies_identical"] and summary["replication"]["dead_servers"] == []
    assert [d["version"] for d in summary["servers_detail"]] == [8, 8]
    assert [[d["from_round"] for d in s["drops"]] for s in summary["servers_detail"]] == [[3], [3]]
    _same(tmp_path / "r1", r0_killed_at_3, f"r = 1, worker 2 {how} at step 3, vs r = 0, killed as step 3 began")


PAUSED = ps(3, servers=2)   # 3 workers, 2 servers: each holds both partitions with r = 1 (its own, the other's replica)


def _paused_and_back(name: str, out: Path, replicas: int, step: float) -> dict:
    """Worker 2 of 3 stopped as step 3 begins, past backend.timeout_s (each partition's first holder drops it from
    round 3), workers 0 and 1 as step 5 begins, so that the run is still at round 5 when worker 2 returns: back,
    worker 2's push of step 3 is refused, it asks to rejoin at round 6, and every server takes it back there once
    round 5 is in (test_faults' r = 0 test, with 3 workers). Every wait is set from `step`, the slowest step of the
    same run without the pauses, measured first: the timeout 5 steps (at least 1 s: no round of the run waits that
    long for a worker that is not stopped); worker 2 back 4 steps after it (workers 0 and 1 have done round 4, one
    step, and stopped by then); workers 0 and 1 stopped for the timeout (worker 2's step 3 and its rejoin, about 2
    steps, are in 3 steps before they return, and its rejoin is held less than the timeout)."""
    timeout = max(1.0, 5 * step)
    fault = {"pause": [{"node": "worker 2", "step": 3, "seconds": timeout + 4 * step},
                       {"node": "worker 0", "step": 5, "seconds": timeout},
                       {"node": "worker 1", "step": 5, "seconds": timeout}]}
    return psarch.run(_cfg(name, dict(PAUSED, timeout_s=timeout, replicas=replicas), fault, steps=10), out,
                      echo=False)


def test_a_paused_worker_that_returns_is_taken_back_at_the_same_round_by_every_holder(tmp_path):
    """r = 1, 3 workers, 2 servers (each holds both partitions: its own and the other's replica). Worker 2 is dropped
    from round 3 by each partition's first holder, its replicas following their commits; back, it is re-admitted at
    round 6 by both servers, and each holder's round 6 sums it again (the first holder decides, its follower sums
    what the commit names). The run finishes with no worker lost, the copies bit for bit equal, and the model of
    the r = 0 run with the same pauses (the same rounds: 0-2 and 6-9 all three workers', 3-5 workers 0 and 1's)."""
    plain = tmp_path / "plain"   # r = 1 without the pauses: its steps are r = 0's or slower
    psarch.run(_cfg("plain", dict(PAUSED, replicas=1), steps=10), plain, echo=False)
    step = _slowest_step(plain)
    base = _paused_and_back("r0", tmp_path / "r0", 0, step)
    rep = _paused_and_back("r1", tmp_path / "r1", 1, step)
    assert _children() == []
    drop = [{"worker": 2, "from_round": 3, "died": False, "readmitted_at": 6}]
    for s in (base, rep):
        assert s["status"] == "finished" and s["lost_workers"] == [] and s["dropped_workers"] == drop
        assert [d["drops"] for d in s["servers_detail"]] == [drop, drop]
        assert [d["version"] for d in s["servers_detail"]] == [10, 10]
    assert rep["replication"]["copies_identical"] and rep["replication"]["dead_servers"] == []
    rank2 = [json.loads(x) for x in (tmp_path / "r1" / "ranks" / "rank2.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rank2] == [0, 1, 2, 3, 6, 7, 8, 9] and rank2[3]["extra"]["rejoined_at"] == 6
    _same(tmp_path / "r1", tmp_path / "r0", "r = 1 vs r = 0, worker 2 paused at step 3 and taken back at round 6")
