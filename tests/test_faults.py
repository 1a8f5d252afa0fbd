"""[faults]: nodes killed or paused at named steps by the launcher, in every backend family. Each test injects
a fault and checks what the run does: goes on (PS modes that go on without a worker; a pause shorter than the
timeout), or stops with one line naming the node (a dead server with no replica, a dead rank of a collective);
what was struck is in summary.json, and no process or network namespace is left."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import psarch
from cluster_setup import leftovers, needs_root, watchers
from parity import assert_same_model
from ps_setup import config, ps
from psarch.config import ConfigError, from_dict
from psarch.config.faults import faults, holds
from psarch.errors import RunError
from psarch.launch.faults import restarts_due
from psarch.launch.lifecycle import TICK_S
from psarch.launch.ranks import run
from psarch.ps.errors import ServiceError
from test_ps_faults import _children

SGD = {"optimizer": "sgd", "lr": 0.1, "steps": 8}


def _cfg(name: str, backend: dict, fault: dict, **sections):
    return from_dict(config(name, train=dict(SGD, **sections.pop("train", {})), backend=backend, faults=fault,
                            **sections))


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _streamed(out: Path, rank: int) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "ranks" / f"rank{rank}.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ the section, checked before any process

@pytest.mark.parametrize("fault, backend, error", [
    ({"kill": [{"node": "worker 3", "step": 2}]}, ps(2), r'faults.kill\[0\].node = "worker 3": unknown node; '
                                                         r'workers are 0..1'),
    ({"kill": [{"node": "server 1", "step": 2}]}, ps(2), r'"server 1": unknown node; servers are 0..0'),
    ({"kill": [{"node": "server 0", "step": 2}]}, {"kind": "ddp", "world_size": 2},
     r'"server 0": unknown node; backend.kind = "ddp" runs no server'),
    ({"kill": [{"node": "worker 1", "step": 8}]}, ps(2), r"faults.kill\[0\].step = 8: expected a step in 0..7"),
    ({"pause": [{"node": "worker 1", "step": 2}]}, ps(2), r"faults.pause\[0\] = .*expected a table with node, "
                                                          r"step, seconds"),
    ({"pause": [{"node": "worker 1", "step": 2, "seconds": -1}]}, ps(2), r"seconds = -1: expected a number"),
    ({"kill": [{"node": "rank 1", "step": 2}]}, ps(2), r'expected "worker I" or "server I"'),
    ({"kill": [{"node": "worker 1", "step": 2}], "pause": [{"node": "worker 1", "step": 4, "seconds": 1}]}, ps(2),
     r"worker 1 at step 4: it was killed at step 2"),
    ({"kill": [{"node": "worker 0", "step": 2}, {"node": "server 0", "step": 4}]}, ps(2),
     r"server 0 at step 4: a server's fault is timed by worker 0, killed at step 2"),
    ({"kill": [{"node": "server 0", "step": 2}]}, ps(1), r"a single worker runs in the launcher's own process"),
    ({"kill": [{"node": "worker 1", "step": 2}]}, {"kind": "dp", "world_size": 2},
     r'backend.kind = "dp" runs its 2 workers as threads in the launcher\'s own process'),
    ({"restart": "replace"}, ps(2), r'faults.restart = "replace": backend.kind = "ps" goes on without a dead worker'),
    ({"restart": "replace"}, {"kind": "ddp", "world_size": 2}, r'faults.restart = "replace": restarts from the newest '
                                                               r'checkpoint, so it needs train.checkpoint_every > 0'),
])
def test_a_fault_no_run_could_meet_is_one_line(fault, backend, error):
    with pytest.raises(ConfigError, match=error) as e:
        _cfg("bad", backend, fault)
    assert "\n" not in str(e.value)


def test_a_restart_is_due_only_for_a_kill_since_the_last_start():
    """Two kills that end one world make one restart; a later failure that no new kill explains stops the run."""
    from types import SimpleNamespace
    cfg = SimpleNamespace(faults=SimpleNamespace(restart="replace"))
    kill = {"node": "worker 1", "action": "kill", "step": 3}
    two = [kill, {**kill, "node": "worker 2"}]
    assert restarts_due(cfg, two, [])
    after = [{"error": "", "stopped_at_s": None, "at_s": 0.0, "from_step": 2, "steps_lost": 1, "kills": 2}]
    assert not restarts_due(cfg, two, after)
    assert restarts_due(cfg, [*two, {**kill, "node": "worker 0", "step": 6}], after)
    assert not restarts_due(SimpleNamespace(faults=SimpleNamespace(restart="none")), two, [])


def test_faults_strike_in_step_order_each_held_by_its_worker():
    cfg = _cfg("ok", ps(3, servers=2), {"kill": [{"node": "worker 2", "step": 6}, {"node": "server 1", "step": 5}],
                                        "pause": [{"node": "worker 1", "step": 3, "seconds": 2}]})
    assert [(f.node, f.action, f.step) for f in faults(cfg)] == [("worker 1", "pause", 3), ("server 1", "kill", 5),
                                                                 ("worker 2", "kill", 6)]
    assert [holds(cfg, r) for r in range(3)] == [[5], [3], [6]]   # a server's fault is timed by worker 0


def test_resuming_a_faulted_run_is_refused_in_one_line(tmp_path):
    cfg = _cfg("resume", ps(2, "async"), {"kill": [{"node": "worker 1", "step": 3}]})
    with pytest.raises(ConfigError, match=r"^--resume: this run injects \[faults\] at named steps") as e:
        run(cfg, tmp_path / "resume", echo=False, resume=True)
    assert "\n" not in str(e.value) and not (tmp_path / "resume").exists()   # refused before anything is written


# ------------------------------------------------------------------ the parameter server

def test_async_goes_on_without_a_killed_worker_and_takes_back_a_paused_one(tmp_path):
    out = tmp_path / "async"
    summary = psarch.run(_cfg("async", ps(3, "async", timeout_s=5.0),
                              {"kill": [{"node": "worker 2", "step": 3}],
                               "pause": [{"node": "worker 1", "step": 2, "seconds": 1.0}]}), out, echo=False)
    assert _children() == []
    assert summary["status"] == "finished" and [w["rank"] for w in summary["lost_workers"]] == [2]
    assert "rank 2 was killed by SIGKILL" in summary["lost_workers"][0]["error"]
    struck = {s["node"]: s for s in summary["faults"]}
    assert struck["worker 2"]["signal"] == "SIGKILL" and struck["worker 2"]["step"] == 3
    assert struck["worker 1"]["signal"] == "SIGSTOP"
    assert struck["worker 1"]["resumed_at_s"] - struck["worker 1"]["at_s"] >= 1.0
    assert _streamed(out, 2) == [0, 1, 2]             # struck exactly as step 3 began
    assert "fault: worker 2 kill (SIGKILL) as step 3 began" in (out / "report.txt").read_text()
    assert _streamed(out, 1) == list(range(8))        # the paused worker came back and finished
    # every push of the survivors landed, none of the dead worker's after its death
    assert summary["servers_detail"][0]["version"] == 3 + 8 + 8


def test_sync_goes_on_with_the_others_when_a_worker_is_killed(tmp_path):
    out = tmp_path / "sync"
    summary = psarch.run(_cfg("sync", ps(3, timeout_s=5.0), {"kill": [{"node": "worker 2", "step": 3}]}), out,
                         echo=False)
    assert _children() == []
    assert summary["status"] == "finished" and [w["rank"] for w in summary["lost_workers"]] == [2]
    assert _streamed(out, 2) == [0, 1, 2] and _streamed(out, 0) == _streamed(out, 1) == list(range(8))
    assert [d["version"] for d in summary["servers_detail"]] == [8] and summary["faults"][0]["node"] == "worker 2"


def _slowest_step(out: Path) -> float:
    """The slowest step of a finished run (metrics.jsonl, the first step's warm-up included), seconds."""
    return max(json.loads(x)["step_time_s"] for x in (out / "metrics.jsonl").read_text().splitlines())


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Sync runs of 2 workers, 10 steps, without faults, each run once for the module: servers -> (its folder, its
    summary)."""
    runs: dict[int, tuple[Path, dict]] = {}

    def get(servers: int) -> tuple[Path, dict]:
        if servers not in runs:
            out = tmp_path_factory.mktemp(f"plain{servers}") / "plain"
            runs[servers] = out, psarch.run(from_dict(config("plain", train=dict(SGD, steps=10),
                                                             backend=ps(2, servers=servers))), out, echo=False)
        return runs[servers]
    return get


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_drops_a_worker_paused_past_the_timeout_and_takes_it_back_when_it_returns(tmp_path, plain, servers):
    """Worker 1 of 2 stopped as step 3 begins, past backend.timeout_s: round 3 waits the timeout and goes on with
    worker 0 alone, which then stops as step 5 begins (so that the run is still at round 5 when worker 1 returns).
    Continued, worker 1 computes step 3, is refused as dropped (the server at round 5), asks to rejoin at round 6,
    is taken back once worker 0's round 5 is in, pulls round 6's parameters and trains on from there: the run
    finishes with both workers, none lost, every round applied; each server says from which round it dropped
    worker 1 and at which it took it back, and so does report.txt's last line.
    Every wait is set from the slowest step s of the same run without the pauses, measured here first: the timeout
    5 s (no round of the run waits that long for a worker that is not stopped); worker 1 back 4 s after it (worker
    0 has done round 4, one step, and stopped by then); worker 0 stopped for the timeout (worker 1's step 3 and
    its rejoin, about 2 s, are in 3 s before worker 0 returns, and its rejoin is held less than the timeout)."""
    step = _slowest_step(plain(servers)[0])
    timeout = max(1.0, 5 * step)
    out = tmp_path / "sync-paused"
    summary = psarch.run(_cfg("paused", ps(2, servers=servers, timeout_s=timeout),
                              {"pause": [{"node": "worker 1", "step": 3, "seconds": timeout + 4 * step},
                                         {"node": "worker 0", "step": 5, "seconds": timeout}]},
                              train={"steps": 10}), out, echo=False)
    assert _children() == []
    assert summary["status"] == "finished" and summary["lost_workers"] == []
    assert summary["dropped_workers"] == [{"worker": 1, "from_round": 3, "died": False, "readmitted_at": 6}]
    assert [d["drops"] for d in summary["servers_detail"]] == [summary["dropped_workers"]] * servers
    assert [d["version"] for d in summary["servers_detail"]] == [10] * servers
    # worker 1: step 3 computed and refused, rounds 4 and 5 worker 0's alone, then every round to the end
    assert _streamed(out, 1) == [0, 1, 2, 3, 6, 7, 8, 9] and _streamed(out, 0) == list(range(10))
    rank1 = [json.loads(x) for x in (out / "ranks" / "rank1.jsonl").read_text().splitlines()]
    assert rank1[3]["extra"]["rejoined_at"] == 6
    rank0 = [json.loads(x) for x in (out / "ranks" / "rank0.jsonl").read_text().splitlines()]
    assert rank0[3]["step_time_s"] >= timeout   # detected: the round of step 3 waited the whole timeout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [len(r.get("workers", [r])) for r in rows] == [2, 2, 2, 2, 1, 1, 2, 2, 2, 2]
    assert (out / "report.txt").read_text().splitlines()[-1] == \
        "dropped: worker 1 from round 3 (no push within backend.timeout_s), re-admitted at round 6"


def test_sync_with_a_pause_shorter_than_the_timeout_ends_with_the_model_of_the_run_without_it(tmp_path, plain):
    base_out, base = plain(1)
    out = tmp_path / "paused"
    summary = psarch.run(_cfg("paused", ps(2), {"pause": [{"node": "worker 1", "step": 4, "seconds": 1.0}]},
                              train={"steps": 10}), out, echo=False)
    assert _children() == []
    assert summary["steps"] == base["steps"] == 10 and summary["faults"][0]["resumed_at_s"] > 0
    assert_same_model(torch.load(out / "model.pt", weights_only=True),
                      torch.load(base_out / "model.pt", weights_only=True), "paused vs plain", rtol=0.0, atol=0.0)


def test_a_killed_server_stops_the_run_with_one_line_naming_it(tmp_path):
    out = tmp_path / "server"
    with pytest.raises(ServiceError, match=r"^server 1 died \(exit code -9\)$"):
        psarch.run(_cfg("server", ps(2, servers=2, timeout_s=3.0), {"kill": [{"node": "server 1", "step": 3}]}),
                   out, echo=False)
    assert _children() == []
    s = _summary(out)
    assert s["status"] == "failed" and s["error"] == "server 1 died (exit code -9)"
    assert s["faults"] == [dict(s["faults"][0], node="server 1", action="kill", step=3, signal="SIGKILL")]
    assert s["stopped_at_s"] >= s["faults"][0]["at_s"]   # the launcher found it after the strike
    assert _streamed(out, 0)[:3] == [0, 1, 2] and len(_streamed(out, 0)) <= 4   # held at step 3; one more at most


def test_a_server_stopped_longer_than_the_timeout_stops_the_run_naming_it(tmp_path):
    with pytest.raises(ServiceError, match=r"^server 0 \(pid \d+\) has been stopped \(SIGSTOP\?\) for more than "
                                           r"backend.timeout_s = 2 s$"):
        psarch.run(_cfg("stopped", ps(2, timeout_s=2.0), {"pause": [{"node": "server 0", "step": 2, "seconds": 600}]}),
                   tmp_path / "stopped", echo=False)
    assert _children() == []   # continued (SIGCONT) before it was stopped: nothing is left stopped either


# ------------------------------------------------------------------ collectives

@pytest.mark.parametrize("backend", [{"kind": "ddp", "world_size": 2, "comm": "ring", "timeout_s": 5.0},
                                     {"kind": "zero", "world_size": 2, "stage": 2, "timeout_s": 5.0}])
def test_a_killed_rank_stops_a_collective_run_naming_it(tmp_path, backend):
    out = tmp_path / backend["kind"]
    with pytest.raises(RunError, match=r"^rank 1 was killed by SIGKILL"):
        psarch.run(_cfg(backend["kind"], backend, {"kill": [{"node": "worker 1", "step": 3}]}), out, echo=False)
    assert _children() == []
    s = _summary(out)
    assert s["status"] == "failed" and s["error"].startswith("rank 1 was killed by SIGKILL")
    assert [f["node"] for f in s["faults"]] == ["worker 1"] and _streamed(out, 1) == [0, 1, 2]


# ------------------------------------------------------------------ on the emulated cluster

@needs_root
@pytest.mark.parametrize("backend, fault, error", [
    (ps(2, servers=2, timeout_s=3.0), {"node": "server 1", "step": 3}, r"^server 1 died"),
    ({"kind": "ddp", "world_size": 2, "comm": "ring", "timeout_s": 5.0}, {"node": "worker 0", "step": 3},
     r"^rank 0 was killed by SIGKILL"),
])
def test_on_the_emulated_cluster_a_fault_stops_the_run_and_leaves_nothing(tmp_path, backend, fault, error):
    cfg = _cfg("emulated", backend, {"kill": [fault]}, cluster={"emulate": True, "link_mbps": 200.0})
    with pytest.raises((RunError, ServiceError), match=error):
        psarch.run(cfg, tmp_path / "emulated", echo=False)
    assert _children() == [] and not leftovers(os.getpid()) and not watchers(os.getpid())
    assert [f["node"] for f in _summary(tmp_path / "emulated")["faults"]] == [fault["node"]]


@needs_root
def test_on_the_emulated_cluster_async_goes_on_without_a_killed_worker(tmp_path):
    cfg = _cfg("emulated", ps(2, "async", timeout_s=5.0), {"kill": [{"node": "worker 1", "step": 3}]},
               cluster={"emulate": True, "link_mbps": 200.0})
    summary = psarch.run(cfg, tmp_path / "emulated", echo=False)
    assert summary["status"] == "finished" and [w["rank"] for w in summary["lost_workers"]] == [1]
    assert _children() == [] and not leftovers(os.getpid()) and not watchers(os.getpid())


# ------------------------------------------------------------------ elastic restart (faults.restart = "replace")

@pytest.mark.parametrize("cluster", [{}, pytest.param({"emulate": True, "link_mbps": 200.0}, marks=needs_root,
                                                      id="emulated")])
def test_a_replaced_sgd_run_ends_bit_for_bit_with_the_model_of_the_uninterrupted_run(tmp_path, cluster):
    """Worker 1 killed as step 5 begins; the world starts again from checkpoint 4 in the same run folder and
    finishes: the same model, bit for bit, every step's metrics once, the restart in the summary."""
    backend = {"kind": "ddp", "world_size": 2, "comm": "ring", "timeout_s": 5.0}
    train = {"momentum": 0.9, "checkpoint_every": 2}
    plain = psarch.run(from_dict(config("plain", train=dict(SGD, **train), backend=backend, cluster=cluster)),
                       tmp_path / "plain", echo=False)
    [only] = plain["worlds"]   # every run records its world: launched at 0, its first step after, then 8 steps
    assert only["launched_at_s"] < 1e-3 and only["first_step"] == 0 and only["steps"] == 8
    assert 0 < only["first_step_at_s"] < plain["ended_at_s"] and only["step_time_s"] > 0
    assert plain["dilation"] == (plain["virtual_device"]["dilation"] if "virtual_device" in plain else 1.0)
    out = tmp_path / "replaced"
    summary = psarch.run(_cfg("replaced", backend, {"kill": [{"node": "worker 1", "step": 5}], "restart": "replace"},
                              train=train, cluster=cluster), out, echo=False)
    assert _children() == [] and not leftovers(os.getpid()) and not watchers(os.getpid())
    assert summary["status"] == "finished" and summary["steps"] == 8
    [restart] = summary["restarts"]
    assert restart["from_step"] == 4 and restart["steps_lost"] == 1 and restart["error"].startswith("rank 1 was killed")
    assert summary["faults"][0]["at_s"] <= restart["stopped_at_s"] <= restart["at_s"]
    assert "restart: from step 4 " in (out / "report.txt").read_text()
    # what it cost: measured steps lost as theory.failures predicts for a kill at step 5, checkpoints every 2
    [cost] = summary["failure_cost"]["restarts"]
    assert cost["kill_step"] == 5 and cost["steps_lost"] == cost["steps_lost_predicted"] == 1
    assert cost["detection_s"] >= 0
    assert cost["detection_s"] == pytest.approx(restart["stopped_at_s"] - summary["faults"][0]["at_s"])
    assert summary["failure_cost"]["wall_s"] >= restart["at_s"] and summary["failure_cost"]["goodput_steps_per_s"] > 0
    assert "failure cost: kill at step 5: time lost " in (out / "report.txt").read_text()
    if cluster:   # what the point cost in wall time: from the launch, not from the epoch of some other clock
        assert 0 < summary["cluster"]["wall_s"] < 900
    # each world's launch and first step: the first from step 0, struck as step 5 began; the second from checkpoint 4
    first, second = summary["worlds"]
    assert (first["first_step"], first["steps"], second["first_step"], second["steps"]) == (0, 5, 4, 4)
    assert first["launched_at_s"] < 1e-3 < first["first_step_at_s"] < summary["faults"][0]["at_s"]
    assert second["launched_at_s"] >= restart["at_s"] and second["first_step_at_s"] > second["launched_at_s"]
    # time lost, measured: detection, relaunch, the new world's start-up and step 4 done again (its metrics' time);
    # predicted from the first world's start-up and step time and the launcher's waits
    step4 = json.loads((out / "metrics.jsonl").read_text().splitlines()[4])["step_time_s"]
    us = pytest.approx   # to the microsecond the records are rounded to
    assert cost["startup_s"] == us(second["first_step_at_s"] - second["launched_at_s"], abs=2e-6)
    assert cost["recompute_s"] == us(step4, abs=1e-6)
    assert cost["time_lost_s"] == us(cost["detection_s"] + cost["relaunch_s"] + cost["startup_s"] + step4, abs=5e-6)
    probe = us(first["first_step_at_s"] - first["launched_at_s"], abs=2e-6)
    assert cost["startup_predicted_s"] == probe
    assert cost["detection_predicted_s"] == us(TICK_S / summary["dilation"], abs=1e-6)
    assert cost["time_lost_predicted_s"] == us(cost["detection_predicted_s"] + cost["startup_predicted_s"]
                                               + first["step_time_s"], abs=5e-6)
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == list(range(8))
    assert_same_model(torch.load(out / "model.pt", weights_only=True),
                      torch.load(tmp_path / "plain" / "model.pt", weights_only=True), "replaced vs plain",
                      rtol=0.0, atol=0.0)


def test_a_fault_is_timed_by_the_step_a_worker_goes_on_from_not_by_its_streamed_lines(tmp_path):
    """A re-admitted PS worker skips the rounds that went on without it: its stream reads steps 0-3, 6, 7, so the
    launcher must hold its step-8 fault against 8 (the last step + 1), not 6 lines; a line cut by a kill is not
    read."""
    from psarch.launch import outputs
    from psarch.launch.faults import _next_step, steps_done

    assert _next_step(tmp_path, 1) == 0
    path = outputs.stream_path(tmp_path, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "rank": 1}) + "\n" for s in (0, 1, 2, 3, 6, 7)) + '{"step": 8, "ra')
    assert _next_step(tmp_path, 1) == 8
    assert steps_done(tmp_path, 2) == 8
