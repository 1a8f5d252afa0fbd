"""summary.json's `failure_cost`: what each restart (faults.restart = "replace" or "shrink") cost a finished run,
measured from the launcher's records (faults[], restarts[], worlds[], ended_at_s) and the steps' times, beside
psarch.theory.failures' prediction. The prediction uses only what the first world measured before any failure:
its launch to first step (the start-up), its median step time, and the launcher's poll interval (detection). A
world restarted at another size (shrink: N - 1) steps at the first world's step times the step simulator's ratio
of its step at that size to its step at the first world's (`step_at`: theory.world_step, the global batch kept),
in its recomputation and in the predicted goodput. Detection is the lower bound, a tick: a killed worker's world
stops once its peers have failed too, which the launcher waits for up to lifecycle.ECHO_GRACE_S, but they
usually exit far sooner, and how soon depends on this machine's load, which nothing before the failure shows
(the grace as the prediction, and a probe of one rank's start-up, were tried: experiments/failures/README.md).
Where faults.startup_s paces every world's start-up as the cluster's (psarch.cluster.startup), that is the
predicted start-up: an input, so the prediction's check is of detection, relaunch and recomputation."""
from __future__ import annotations

from typing import Callable

from psarch.launch.lifecycle import TICK_S
from psarch.records import FailureCost, RestartCost, Summary
from psarch.theory import failures

StepAt = Callable[[int], "float | None"]   # the simulated step at a world size (None: not predicted)


def failure_cost(s: Summary, checkpoint_every: int, step_times: dict[int, float],
                 step_at: StepAt | None = None, startup_s: float = 0.0) -> FailureCost:
    """Goodput over the whole run and each restart's detection, relaunch, start-up and recomputation, measured |
    predicted (s: a finished run's summary with its step_time_s, faults, restarts, worlds and ended_at_s;
    step_times: each step's measured time, the slowest rank's, as metrics.jsonl; step_at: the simulated step at a
    world size, for worlds restarted at another size than the first's; startup_s: faults.startup_s, the start-up
    every world was paced to, 0 where it was not)."""
    kills = [f for f in s["faults"] if f["action"] == "kill"]   # in the order struck
    worlds = s.get("worlds") or []
    d = s.get("dilation") or s.get("virtual_device", {}).get("dilation", 1.0)
    detection_pred = round(TICK_S / d, 6)
    startup_pred = startup_s or (_startup(worlds[0]) if worlds else None)
    step_pred = _step_predicted(worlds, step_at)
    costs: list[RestartCost] = []
    before = 0   # the kills struck before this restart's world (the previous restart's count)
    for i, r in enumerate(s["restarts"]):
        first = kills[before]   # the kill that ended this world
        stopped = r["stopped_at_s"]
        detection = round(stopped - first["at_s"], 6) if stopped is not None else None
        relaunch = round(r["at_s"] - stopped, 6) if stopped is not None else None
        startup = _startup(worlds[i + 1]) if i + 1 < len(worlds) else None
        lost_pred = failures.steps_lost(first["step"], checkpoint_every)
        recompute = round(sum(step_times.get(k, 0.0) for k in range(r["from_step"], first["step"])), 6)
        parts = (detection, relaunch, startup)
        step_then = step_pred(r["world_size"])   # the steps done again are the restarted world's
        costs.append({"kill_step": first["step"], "detection_s": detection, "detection_predicted_s": detection_pred,
                      "relaunch_s": relaunch, "startup_s": startup, "startup_predicted_s": startup_pred,
                      "steps_lost": r["steps_lost"], "steps_lost_predicted": lost_pred, "recompute_s": recompute,
                      "world_size": r["world_size"], "step_predicted_s": step_then,
                      "recompute_predicted_s": lost_pred * step_then if step_then is not None else None,
                      "time_lost_s": round(sum(parts) + recompute, 6) if None not in parts else None,   # type: ignore
                      "time_lost_predicted_s": _predicted(detection_pred, startup_pred, lost_pred, step_then)})
        before = r["kills"]
    wall = s["ended_at_s"]
    step_time = s["step_time_s"]
    after = step_pred(s["restarts"][0]["world_size"]) if s["restarts"] else step_pred(None)
    return {"wall_s": wall, "goodput_steps_per_s": s["steps"] / wall if wall > 0 else 0.0,
            "goodput_predicted_steps_per_s": _goodput(s, costs, startup_pred, step_pred, detection_pred),
            "ideal_steps_per_s": 1 / step_time if step_time > 0 else 0.0, "checkpoint_every": checkpoint_every,
            "mean_steps_lost_predicted": failures.mean_steps_lost(checkpoint_every),
            "mean_time_lost_predicted_s": _predicted(detection_pred, startup_pred,
                                                     failures.mean_steps_lost(checkpoint_every), after),
            "restarts": costs}


def _step_predicted(worlds: list, step_at: StepAt | None) -> Callable[[int | None], float | None]:
    """The predicted step of a world of n ranks (None: the first world's size): the first world's median step,
    times step_at(n) / step_at(its size) where n differs (None where either is not predicted)."""
    first = worlds[0] if worlds else None
    measured = first["step_time_s"] if first else None

    def at(n: int | None) -> float | None:
        if measured is None or n is None or first is None or n == first["world_size"]:
            return measured
        there, here = (step_at(n), step_at(first["world_size"])) if step_at is not None else (None, None)
        return measured * there / here if there is not None and here else None
    return at


def _goodput(s: Summary, costs: list[RestartCost], startup: float | None,
             step_at: Callable[[int | None], float | None], detection: float) -> float | None:
    """Steps over the predicted wall time: the first world's start-up, each world's steps at its predicted step (the
    first from step 0 to its kill, each restarted one from the checkpoint before that kill to the next kill or the
    end), and each restart's detection and start-up (theory.failures.time_lost's parts; the relaunch is not
    predicted). None where a part is not predicted."""
    if startup is None:
        return None
    wall, begin, size = startup, 0, None
    for c in costs:
        step = step_at(size)
        if step is None:
            return None
        wall += (c["kill_step"] - begin) * step + detection + startup
        begin, size = c["kill_step"] - c["steps_lost_predicted"], c["world_size"]
    last = step_at(size)
    if last is None:
        return None
    wall += (s["steps"] - begin) * last
    return s["steps"] / wall if wall > 0 else None


def _startup(w: dict) -> float | None:
    """A world's launch to its first step (None where no step began)."""
    return round(w["first_step_at_s"] - w["launched_at_s"], 6) if w.get("first_step_at_s") is not None else None


def _predicted(detection: float, startup: float | None, steps: float, step_time: float | None) -> float | None:
    if startup is None or step_time is None:
        return None
    return round(failures.time_lost(detection, startup, steps, step_time), 6)


def report_lines(c: FailureCost) -> list[str]:
    """report.txt's lines: goodput, then one per restart, measured | predicted."""
    predicted = c.get("goodput_predicted_steps_per_s")
    lines = [f"goodput         {c['goodput_steps_per_s']:.2f} | predicted "
             f"{f'{predicted:.2f}' if predicted is not None else '?'} steps/s over {c['wall_s']:.2f} s "
             f"(ideal {c['ideal_steps_per_s']:.2f} steps/s at the median step)"]
    for r in c["restarts"]:
        lines.append(f"failure cost: kill at step {r['kill_step']}: time lost {_s(r['time_lost_s'])} | predicted "
                     f"{_s(r['time_lost_predicted_s'])} (N = {r['world_size']}): detection {_s(r['detection_s'])} | "
                     f"{_s(r['detection_predicted_s'])}, relaunch {_s(r['relaunch_s'])} | -, start-up "
                     f"{_s(r['startup_s'])} | {_s(r['startup_predicted_s'])}, recompute {_s(r['recompute_s'])} | "
                     f"{_s(r['recompute_predicted_s'])}; steps lost {r['steps_lost']} | predicted "
                     f"{r['steps_lost_predicted']} (mean over a random step {c['mean_steps_lost_predicted']:.1f})")
    return lines


def _s(x: float | None) -> str:
    return f"{x:.3f} s" if x is not None else "?"
