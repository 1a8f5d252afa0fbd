"""faults.startup_s: every world's start-up paced as the cluster's (psarch/cluster/startup.py). Refused where there
is no modelled device to pace; on the emulated cluster each world of a faulted collective run begins its first step
at its launch + startup_s (the cluster's time), the restart's prediction takes it; a start-up this host cannot meet
is reported as an overrun, never silently."""
from __future__ import annotations

import json
import os
import time

import pytest

import psarch
from cluster_setup import leftovers, needs_root, watchers
from parity import config
from psarch.cluster import startup
from psarch.config import ConfigError, from_dict
from psarch.launch.lifecycle import TICK_S
from test_ps_faults import _children

RING = {"kind": "ddp", "world_size": 2, "comm": "ring", "timeout_s": 20.0}
SGD = {"optimizer": "sgd", "lr": 0.1, "steps": 6}
# a custom virtual device at a fixed D (no probes): the deadline, startup_s x D of wall clock, is known
EMULATED = {"emulate": True, "link_mbps": 200.0, "device_tflops": 0.05, "dilation": 4}
WAKE_S = 5 * TICK_S   # a rank's wake-up from its wait, on this loaded machine: wall seconds


def _cfg(name: str, startup_s: float, cluster: dict, faults: dict | None = None, **train):
    return from_dict(config(name, train=dict(SGD, **train), backend=RING, cluster=cluster,
                            faults=dict(faults or {}, startup_s=startup_s)))


def _startups(s: dict) -> list[float]:
    """Each world's launch to its first step, the cluster's seconds."""
    return [w["first_step_at_s"] - w["launched_at_s"] for w in s["worlds"]]


# ------------------------------------------------------------------ the key, checked before any process

@pytest.mark.parametrize("cluster", [{}, {"emulate": True, "link_mbps": 200.0, "device": "cpu-measured"}],
                         ids=["loopback", "measured-compute"])
def test_a_paced_start_up_without_a_modelled_device_is_one_line_naming_the_key(cluster):
    with pytest.raises(ConfigError, match=r"^faults.startup_s = 3: paces a world's start-up as the cluster's, which "
                                          r"needs virtual devices on an emulated cluster") as e:
        _cfg("bad", 3.0, cluster)
    assert "\n" not in str(e.value)


def test_a_negative_start_up_is_refused():
    with pytest.raises(ConfigError, match=r"^faults.startup_s = -1(\.0)?: must be >= 0"):
        _cfg("bad", -1, EMULATED)


def test_the_default_paces_nothing_and_a_set_start_up_is_a_deadline_from_the_launch():
    assert _cfg("plain", 0.0, {}).faults.startup_s == 0.0
    cfg = _cfg("ok", 2.5, EMULATED)
    assert startup.deadline(cfg, 100.0) == 100.0 + 2.5 * 4   # the cluster's 2.5 s is 10 s of wall clock at D = 4
    assert startup.deadline(cfg, None) is None and startup.deadline(_cfg("plain", 0.0, {}), 100.0) is None


def test_a_rank_waits_for_the_deadline_and_says_how_late_it_was_past_one():
    assert startup.hold(None) is None
    t = time.monotonic()
    assert startup.hold(t + 0.5) == 0.0 and time.monotonic() >= t + 0.5
    assert startup.hold(time.monotonic() - 1.0) >= 1.0   # ready 1 s after its deadline: it goes on at once


# ------------------------------------------------------------------ on the emulated cluster

@needs_root
def test_each_world_of_a_replaced_run_starts_up_in_the_paced_time_and_the_restart_predicts_it(tmp_path, monkeypatch):
    """Worker 1 killed as step 3 begins, the world replaced from checkpoint 2: both worlds begin their first step at
    their launch + startup_s (the cluster's time), within the wake-up of the last rank (one launcher tick covers it);
    neither overran, and the restart's predicted start-up is startup_s itself."""
    monkeypatch.setenv("PSARCH_THREADS", "1")
    paced = 3.0   # 12 s of wall clock at D = 4: forked ranks start in 1-7 s here (experiments/failures/README.md)
    out = tmp_path / "paced"
    s = psarch.run(_cfg("paced", paced, EMULATED, {"kill": [{"node": "worker 1", "step": 3}], "restart": "replace"},
                        checkpoint_every=2), out, echo=False)
    assert _children() == [] and not leftovers(os.getpid()) and not watchers(os.getpid())
    assert s["status"] == "finished" and len(s["worlds"]) == 2 and s["dilation"] == 4
    late = [w["startup_late_s"] for w in s["worlds"]]
    assert s["startup"]["overrun_worlds"] == sum(x > 0 for x in late)
    assert (s["startup"]["warning"] is None) == (not any(late))
    for measured, x in zip(_startups(s), late):   # never before the deadline; on time: after it by the last rank's
        # wake-up, which a few launcher ticks cover (up to 26 ms of wall clock, 1.3 ticks, in the failures study's 22
        # worlds at load 5-26); late (a loaded host): the deadline plus the lateness it reported
        assert paced - 2e-6 <= measured <= paced + (x if x else WAKE_S / s["dilation"]) + 2e-6, (measured, x)
    [cost] = s["failure_cost"]["restarts"]
    assert cost["startup_predicted_s"] == paced and cost["startup_s"] == pytest.approx(_startups(s)[1], abs=2e-6)
    assert cost["time_lost_predicted_s"] == pytest.approx(cost["detection_predicted_s"] + paced
                                                          + cost["recompute_predicted_s"], abs=5e-6)
    report = (out / "report.txt").read_text()
    assert (f"start-up        paced to faults.startup_s = 3 s (the cluster's) in 2 of 2 world(s); overrun "
            f"{s['startup']['overrun_worlds']}") in report


@needs_root
def test_a_paced_start_up_past_every_timeout_of_a_ps_run_is_waited_out(tmp_path, monkeypatch):
    """A sync PS run whose hold before the first step (startup_s x D) is longer than each of its waits
    (backend.timeout_s, heartbeat_timeout_s, handshake_timeout_s, all x D): its servers, which do not hold, and its
    workers finish every step, no worker lost, every push applied once, the first step at the deadline. No wait runs
    across the hold (psarch/cluster/startup.py): those of the start-up end before it, a step's begin after it."""
    monkeypatch.setenv("PSARCH_THREADS", "1")
    paced, waits = 3.0, {"timeout_s": 2.5, "heartbeat_s": 0.25, "heartbeat_timeout_s": 0.75, "handshake_timeout_s": 1.0}
    cfg = from_dict(config("ps_paced", train=dict(SGD, steps=4), cluster=EMULATED, faults={"startup_s": paced},
                           backend={"kind": "ps", "world_size": 2, "mode": "sync", "servers": 1, **waits}))
    assert all(paced > getattr(cfg.backend, k) for k in waits if k.endswith("timeout_s"))
    s = psarch.run(cfg, tmp_path / "ps_paced", echo=False)
    assert _children() == [] and not leftovers(os.getpid()) and not watchers(os.getpid())
    assert s["status"] == "finished" and s["steps"] == 4 and s["dilation"] == 4
    [srv] = s["servers_detail"]
    assert srv["failure"] is None and srv["lost"] == [] and srv["drops"] == []
    assert srv["applied_pushes"] == 2 * 4 * srv["partitions"] and srv["repeats"] == 0   # each once
    [late] = s["startup"]["late_s"]   # one world
    assert paced - 2e-6 <= _startups(s)[0] <= paced + (late if late else WAKE_S / s["dilation"]) + 2e-6


@needs_root
def test_a_start_up_this_host_cannot_meet_is_reported_as_an_overrun(tmp_path, monkeypatch):
    """1 ms of the cluster's time (4 ms of wall clock) from launch to first step: no world of processes starts that
    fast, so the world is late, and the summary and the report say so."""
    monkeypatch.setenv("PSARCH_THREADS", "1")
    out = tmp_path / "overrun"
    s = psarch.run(_cfg("overrun", 0.001, EMULATED), out, echo=False)
    assert _children() == [] and not leftovers(os.getpid()) and not watchers(os.getpid())
    [world] = s["worlds"]
    assert world["startup_late_s"] > 0   # late by what it took past the deadline: its first step began then
    assert _startups(s)[0] == pytest.approx(0.001 + world["startup_late_s"], abs=WAKE_S / s["dilation"])
    assert s["startup"]["overrun_worlds"] == 1 and s["startup"]["counted_worlds"] == 1
    assert s["startup"]["warning"].startswith("start-up: 1 of 1 world(s) (0) started up after launch + "
                                              "faults.startup_s = 0.001 s")
    assert s["startup"]["warning"] in (out / "report.txt").read_text()
    assert json.loads((out / "summary.json").read_text())["startup"] == s["startup"]


def test_the_summary_counts_the_worlds_that_overran_and_says_so_in_one_line():
    s = startup.summary(_cfg("ok", 2.5, EMULATED), [{"startup_late_s": 0.0}, {"startup_late_s": 0.3}])
    assert (s["counted_worlds"], s["overrun_worlds"], s["late_s"]) == (2, 1, [0.0, 0.3])
    assert s["warning"].startswith("start-up: 1 of 2 world(s) (1) started up after launch + faults.startup_s = 2.5 s "
                                   "(late by up to 0.300 s)")
    assert startup.report_lines(s)[1] == s["warning"] and "\n" not in s["warning"]
    assert startup.summary(_cfg("ok", 2.5, EMULATED), [{"startup_late_s": 0.0}])["warning"] is None
