"""summary.json's `failure_cost`: what each restart (faults.restart = "replace" or "shrink") cost a finished run,
measured from the launcher's records (faults[], restarts[], ended_at_s), beside psarch.theory.failures' prediction."""
from __future__ import annotations

from psarch.records import FailureCost, RestartCost, Summary
from psarch.theory import failures


def failure_cost(s: Summary, checkpoint_every: int) -> FailureCost:
    """Goodput over the whole run and each restart's detection, relaunch and recomputation (s: a finished run's
    summary with its step_time_s, faults, restarts and ended_at_s)."""
    kills = [f for f in s["faults"] if f["action"] == "kill"]   # in the order struck
    step_time = s["step_time_s"]
    costs: list[RestartCost] = []
    before = 0   # the kills struck before this restart's world (the previous restart's count)
    for r in s["restarts"]:
        first = kills[before]   # the kill that ended this world
        stopped = r["stopped_at_s"]
        costs.append({"kill_step": first["step"],
                      "detection_s": round(stopped - first["at_s"], 6) if stopped is not None else None,
                      "relaunch_s": round(r["at_s"] - stopped, 6) if stopped is not None else None,
                      "steps_lost": r["steps_lost"],
                      "steps_lost_predicted": failures.steps_lost(first["step"], checkpoint_every),
                      "recompute_s": r["steps_lost"] * step_time})
        before = r["kills"]
    wall = s["ended_at_s"]
    return {"wall_s": wall, "goodput_steps_per_s": s["steps"] / wall if wall > 0 else 0.0,
            "ideal_steps_per_s": 1 / step_time if step_time > 0 else 0.0, "checkpoint_every": checkpoint_every,
            "mean_steps_lost_predicted": failures.mean_steps_lost(checkpoint_every), "restarts": costs}


def report_lines(c: FailureCost) -> list[str]:
    """report.txt's lines: goodput, then one per restart, measured | predicted."""
    lines = [f"goodput         {c['goodput_steps_per_s']:.2f} steps/s over {c['wall_s']:.2f} s "
             f"(ideal {c['ideal_steps_per_s']:.2f} steps/s at the median step)"]
    for r in c["restarts"]:
        det = f"{r['detection_s']:.2f} s" if r["detection_s"] is not None else "?"
        rel = f"{r['relaunch_s']:.2f} s" if r["relaunch_s"] is not None else "?"
        lines.append(f"failure cost: kill at step {r['kill_step']}: detection {det}, relaunch {rel}, recompute "
                     f"{r['recompute_s'] * 1e3:.2f} ms; steps lost {r['steps_lost']} | predicted "
                     f"{r['steps_lost_predicted']} (mean over a random step {c['mean_steps_lost_predicted']:.1f})")
    return lines
