"""What a failure costs: theory.failures' steps lost (exact at a known step, and its mean over a uniformly
random step), and failure_cost's figures from the launcher's records, one restart or two."""
from __future__ import annotations

import pytest

from psarch.launch.failure_cost import failure_cost, report_lines
from psarch.launch.lifecycle import TICK_S
from psarch.theory.failures import mean_steps_lost, steps_lost, time_lost


@pytest.mark.parametrize("step, every, lost", [(5, 2, 1), (4, 2, 0), (7, 4, 3), (3, 10, 3), (0, 3, 0), (6, 0, 6)])
def test_steps_lost_are_those_past_the_newest_checkpoint(step, every, lost):
    assert steps_lost(step, every) == lost


@pytest.mark.parametrize("every", [1, 2, 5, 8])
def test_the_mean_is_steps_lost_averaged_over_every_step_of_an_interval(every):
    steps = range(0, 40 * every)   # whole intervals: a uniformly random fault step
    assert mean_steps_lost(every) == pytest.approx(sum(steps_lost(k, every) for k in steps) / len(steps))


def test_a_bad_step_or_interval_is_one_line():
    with pytest.raises(ValueError, match=r"^fault step -1: expected a step >= 0$"):
        steps_lost(-1, 2)
    with pytest.raises(ValueError, match=r"^checkpoint_every = 0: expected a checkpoint interval > 0$"):
        mean_steps_lost(0)


def test_time_lost_is_detection_start_up_and_the_steps_done_again():
    assert time_lost(0.25, 2.0, 3, 0.5) == 3.75 and time_lost(0.0, 1.0, 0, 9.0) == 1.0


def _two_restarts() -> dict:
    """Two worlds ended: the first by two kills at step 5 (one restart), the second by a kill at step 7."""
    kill = {"action": "kill", "signal": "SIGKILL"}
    return {"steps": 10, "step_time_s": 0.01, "ended_at_s": 4.0,
            "faults": [dict(kill, node="worker 1", step=5, at_s=1.0), dict(kill, node="worker 2", step=5, at_s=1.0),
                       {"node": "worker 0", "action": "pause", "step": 6, "at_s": 2.0, "seconds": 0.1},
                       dict(kill, node="worker 0", step=7, at_s=2.5)],
            "restarts": [{"error": "", "stopped_at_s": 1.25, "at_s": 1.5, "from_step": 4, "steps_lost": 1,
                          "kills": 2, "world_size": 3},
                         {"error": "", "stopped_at_s": None, "at_s": 3.0, "from_step": 6, "steps_lost": 1,
                          "kills": 3, "world_size": 3}],
            "worlds": [{"launched_at_s": 0.0, "first_step": 0, "first_step_at_s": 0.5, "steps": 5,
                        "step_time_s": 0.04, "world_size": 3},
                       {"launched_at_s": 1.5, "first_step": 4, "first_step_at_s": 2.1, "steps": 3, "step_time_s": 0.01,
                        "world_size": 3},
                       {"launched_at_s": 3.0, "first_step": 6, "first_step_at_s": 3.4, "steps": 4, "step_time_s": 0.01,
                        "world_size": 3}]}


def test_each_restart_is_costed_from_the_kill_that_ended_its_world():
    times = {k: 0.01 for k in range(10)} | {4: 0.03}
    c = failure_cost(_two_restarts(), 2, times)
    assert c["goodput_steps_per_s"] == 2.5 and c["ideal_steps_per_s"] == pytest.approx(100.0)
    assert c["mean_steps_lost_predicted"] == 0.5
    first, second = c["restarts"]
    assert (first["kill_step"], first["detection_s"], first["relaunch_s"]) == (5, 0.25, 0.25)
    assert (first["steps_lost"], first["steps_lost_predicted"], first["recompute_s"]) == (1, 1, 0.03)
    assert (second["kill_step"], second["detection_s"], second["steps_lost_predicted"]) == (7, None, 1)
    lines = report_lines(c)
    assert lines[0].startswith("goodput         2.50 | predicted ") and " steps/s over 4.00 s" in lines[0]
    assert len(lines) == 3
    assert "kill at step 5: time lost 1.130 s | predicted 0.560 s" in lines[1] and "steps lost 1 | predicted 1" in lines[1]


def test_a_restart_is_predicted_from_the_first_world_alone():
    """Start-up, step time and detection predicted from the first world's launch to first step (0.5 s), its
    median step time (0.04 s) and the launcher's poll interval; measured from the restarted world's own."""
    c = failure_cost(_two_restarts(), 2, {k: 0.01 for k in range(10)})
    first, second = c["restarts"]
    assert first["startup_s"] == 0.6 and second["startup_s"] == 0.4
    assert first["startup_predicted_s"] == second["startup_predicted_s"] == 0.5
    assert first["detection_predicted_s"] == TICK_S and first["recompute_predicted_s"] == 0.04
    assert first["time_lost_s"] == pytest.approx(0.25 + 0.25 + 0.6 + 0.01)
    assert first["time_lost_predicted_s"] == pytest.approx(TICK_S + 0.5 + 0.04)
    assert second["time_lost_s"] is None   # the launcher never found the second world stopped: no detection
    assert c["mean_time_lost_predicted_s"] == pytest.approx(TICK_S + 0.5 + 0.5 * 0.04)
    # predicted wall: start-up 0.5, steps 0-4 at 0.04, then per restart detection + start-up, and steps 4-6, 6-9
    wall = 0.5 + 5 * 0.04 + 2 * (TICK_S + 0.5) + (7 - 4) * 0.04 + (10 - 6) * 0.04
    assert c["goodput_predicted_steps_per_s"] == pytest.approx(10 / wall)
    dilated = failure_cost(dict(_two_restarts(), virtual_device={"dilation": 4.0}), 2, {})
    assert dilated["restarts"][0]["detection_predicted_s"] == pytest.approx(TICK_S / 4)   # the cluster's time


def test_a_paced_start_up_is_the_predicted_one():
    """faults.startup_s (every world paced to it): the restart's predicted start-up, in its time lost, the mean
    time lost and the predicted goodput, in place of the first world's measured one (0.5 s); measured as before."""
    c = failure_cost(_two_restarts(), 2, {k: 0.01 for k in range(10)}, startup_s=3.0)
    first, second = c["restarts"]
    assert first["startup_predicted_s"] == second["startup_predicted_s"] == 3.0 and first["startup_s"] == 0.6
    assert first["time_lost_predicted_s"] == pytest.approx(TICK_S + 3.0 + 0.04)
    assert c["mean_time_lost_predicted_s"] == pytest.approx(TICK_S + 3.0 + 0.5 * 0.04)
    wall = 3.0 + 5 * 0.04 + 2 * (TICK_S + 3.0) + (7 - 4) * 0.04 + (10 - 6) * 0.04
    assert c["goodput_predicted_steps_per_s"] == pytest.approx(10 / wall)


def test_a_world_is_read_from_its_ranks_marks_and_streams(tmp_path):
    """The world's first step began when its last rank began it; its steps are its own (not those a checkpoint
    carried into the streams, nor a record a kill cut short), its step time the slowest rank's median after
    warm-up; times since t0 in the cluster's (÷ D)."""
    import json
    from psarch.launch.worlds import world
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    t0 = 100.0
    for rank, began_s in ((0, 101.0), (1, 103.0)):
        (ranks / f"rank{rank}.began").write_text(json.dumps({"step": 4, "at_ns": int(began_s * 1e9)}))
        carried = [{"step": k, "step_time_s": 9.0} for k in range(4)]   # written first by a resumed rank
        own = [{"step": k, "step_time_s": 0.1 * (rank + 1) * (k - 3)} for k in range(4, 8)]
        text = "".join(json.dumps(r) + "\n" for r in carried + own) + '{"step": 8, "step_ti'   # cut by a kill
        (ranks / f"rank{rank}.jsonl").write_text(text)
    w = world(ranks, 0.5, t0, 2.0, warmup=1, world_size=2)
    assert w["launched_at_s"] == 0.5 and w["first_step"] == 4 and w["first_step_at_s"] == 1.5
    assert w["steps"] == 4 and w["step_time_s"] == pytest.approx(0.6)   # rank 1's 0.4, 0.6, 0.8 after step 4
    assert w["world_size"] == 2 and world(tmp_path / "none", 0.0, t0, 1.0, 1, 2)["first_step_at_s"] is None
    assert w["startup_late_s"] is None   # marks without a deadline: the start-up was not paced
    for rank, late in ((0, 0.0), (1, 0.5)):   # paced: rank 1 was ready 0.5 s of wall clock after the deadline
        mark = json.loads((ranks / f"rank{rank}.began").read_text())
        (ranks / f"rank{rank}.began").write_text(json.dumps(dict(mark, late_s=late)))
    assert world(ranks, 0.5, t0, 2.0, warmup=1, world_size=2)["startup_late_s"] == 0.25   # the cluster's time


def _shrunk_once(step_at) -> dict:
    """One kill at step 5 of 10 (checkpoints every 2), the world restarted at `n` from checkpoint 4."""
    def run(n: int) -> dict:
        s = _two_restarts()
        s["faults"], s["restarts"] = s["faults"][:2], [dict(s["restarts"][0], world_size=n)]
        s["worlds"] = [s["worlds"][0], dict(s["worlds"][1], world_size=n, steps=6)]
        return failure_cost(s, 2, {k: 0.01 for k in range(10)}, step_at)
    return {"replace": run(3), "shrink": run(2)}


def test_a_shrunk_world_is_predicted_at_its_own_step():
    """The world restarted at N - 1 steps at the first world's measured step times the simulator's ratio of its
    step at N - 1 to its step at N (here 1.5: each rank computes 3/2 of what it did): its recomputation, its time
    lost and the run's predicted goodput follow it; "replace" keeps the first world's step."""
    runs = _shrunk_once({3: 0.02, 2: 0.03}.get)
    replaced, shrunk = runs["replace"]["restarts"][0], runs["shrink"]["restarts"][0]
    assert replaced["step_predicted_s"] == 0.04 and shrunk["step_predicted_s"] == pytest.approx(0.06)
    assert shrunk["recompute_predicted_s"] == pytest.approx(0.06) and replaced["recompute_predicted_s"] == 0.04
    assert shrunk["time_lost_predicted_s"] == pytest.approx(TICK_S + 0.5 + 0.06)
    wall = 0.5 + 5 * 0.04 + TICK_S + 0.5 + (10 - 4) * 0.06
    assert runs["shrink"]["goodput_predicted_steps_per_s"] == pytest.approx(10 / wall)
    assert runs["shrink"]["goodput_predicted_steps_per_s"] < runs["replace"]["goodput_predicted_steps_per_s"]
    assert runs["shrink"]["mean_time_lost_predicted_s"] == pytest.approx(TICK_S + 0.5 + 0.5 * 0.06)
    # no program at N - 1: not predicted, rather than predicted at N's step
    unknown = _shrunk_once(lambda n: None)["shrink"]
    assert unknown["restarts"][0]["step_predicted_s"] is None and unknown["goodput_predicted_steps_per_s"] is None


def test_the_simulator_predicts_a_longer_step_for_ddp_at_n_minus_1_when_compute_dominates():
    """theory.world_step: DDP's ring at N = 3 and at 2, the global batch kept: each rank computes 3/2 as much,
    and its all-reduce moves 2(N - 1)/N x S, a little less; on 100 Gb/s links the compute decides."""
    from psarch.config import from_dict
    from psarch.theory import world_step
    cfg = from_dict({"train": {"global_batch": 12}, "backend": {"kind": "ddp", "world_size": 3, "comm": "ring"},
                     "cluster": {"link_mbps": 100_000.0}})
    summary = {"params": 1e6, "worlds": [{"step_time_s": 0.1, "world_size": 3}]}
    at3, at2 = world_step(cfg, summary, 3), world_step(cfg, summary, 2)
    assert at3 is not None and at2 is not None and at2 > at3
    assert at2 / at3 == pytest.approx(1.5, rel=0.05)   # the compute's 3/2, the all-reduce a small part
    assert world_step(cfg, {"params": 1e6, "worlds": []}, 2) is None
