"""`psarch compare RUN_DIR ... [--out DIR]`: one table of runs, measured beside predicted, and plots."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from psarch.report import nodes, plots
from psarch.report.links import links_table
from psarch.report.ranks import has_per_rank, rank_table
from psarch.report.sparse import embedding_scaling, is_sparse_run, sparse_table
from psarch.report.curves import diverged
from psarch.report.runs import (Run, fraction_of, label, load_run, name_runs, predicted_rank0_memory,
                                predicted_worker_sent, step_clock, target_fraction,
                                target_gaps, target_words, trailing_mean, worker_sent_per_step)
from psarch.report.seeds import config_key, interval, seed_groups, study_key
from psarch.throughput import LOCKSTEP, OWN_PACE
from psarch.units import fmt_bytes


def comparability_warnings(runs: list[Run]) -> list[str]:
    """Runs compare fairly only on the same workload, data and global batch."""
    warnings = []

    def key(run: Run) -> dict:
        c, s = run["config"], run["summary"]
        w = c.get("workload", {})
        return {"workload": s.get("workload"), "params": s.get("params"), "global_batch": s.get("global_batch"),
                "seq_len": w.get("seq_len"), "data": w.get("markov") if w.get("data") == "markov" else w.get("text"),
                "seed": c.get("seed"), "convergence_target": fraction_of(run)}

    ref = key(runs[0])
    for run in runs[1:]:
        k = key(run)
        for field in ref:
            if k[field] != ref[field]:
                warnings.append(f"{label(run)} differs from {label(runs[0])} in {field}: "
                                f"{json.dumps(k[field])} vs {json.dumps(ref[field])}")
    return warnings


def table(runs: list[Run]) -> str:
    """The comparison table, in Markdown; rank 0's memory and the mean worker's traffic, and a column for each role
    whose nodes serve the ranks in some run (a PS's servers): what one of its nodes receives per step."""
    serving = list(dict.fromkeys(r.name for run in runs for r in nodes.serving(run["summary"])))
    head = ("| run | architecture | N | samples/s | step time (ms) | final loss (last step) | gap | model states/rank "
            "measured \\| predicted | sent/worker/step measured \\| predicted | "
            + "".join(f"{name} recv/step measured \\| predicted | " for name in serving) + "peak memory |")
    lines = [head, "|" + "---|" * (10 + len(serving))]
    for run in runs:
        s = run["summary"]
        m0 = s["memory"]["per_rank"][0]
        pm = predicted_rank0_memory(s)
        sent = worker_sent_per_step(s)
        modelled = " (modelled)" if s["traffic"]["per_rank"][0].get("modelled") else ""
        roles = nodes.roles(s)
        received = [roles[name].mean("received") if name in roles else (None, None) for name in serving]
        srv = "".join(f"{fmt_bytes(m)} \\| {fmt_bytes(p)} | " if m is not None else "- | " for m, p in received)
        gap = f"{s['gap']:.4f}" if s.get("gap") is not None else "-"
        lines.append(f"| {run['run_label']} | {s['label']} | {s['world_size']} | "
                     f"{s['samples_per_s']:.1f} | {s['step_time_s'] * 1e3:.2f} | {s['final_loss']:.4f} | {gap} | "
                     f"{fmt_bytes(m0['total'])} \\| {fmt_bytes(pm)} | {fmt_bytes(sent)}{modelled} \\| {fmt_bytes(predicted_worker_sent(s))} | {srv}"
                     f"{fmt_bytes(m0.get('peak'))} |")
    return "\n".join(lines)


def rate_note(runs: list[Run]) -> str:
    """What the samples/s column means for these runs (psarch/throughput.py)."""
    own = [r["run_label"] for r in runs if not r["summary"]["lockstep"]]
    note = f"samples/s: {LOCKSTEP}"
    if own:
        note += f" where workers step in lockstep; {OWN_PACE} where they run at their own pace ({', '.join(own)})"
    return note + "."


def convergence(runs: list[Run], absolute: float | None = None, last: int = 20, window: int = 10) -> str:
    """How fast each run converged, in Markdown: the gap to the entropy floor as the mean of the last
    `last` steps (one small batch's loss is too noisy to rank runs by), the target gap (`absolute`, else half
    of its workload's initial gap: runs.target_gaps), and the first step and wall-clock time of steps at which
    the `window`-step mean gap fell below it. Runs without a floor say so; empty when no run has one.
    The default target is a fraction of the initial gap (the config key convergence_target) that the modes reach
    at different steps: most of the initial gap goes in the first steps of every mode alike."""
    if all(r["summary"].get("entropy_floor") is None or not r["metrics"] for r in runs):
        return ""
    lines = [f"| run | N | gap, mean of last {last} steps | target gap | steps to target | time to target (s) | "
             "staleness mean / max |", "|---|---|---|---|---|---|---|"]
    for run, target in zip(runs, target_gaps(runs, absolute)):
        s = run["summary"]
        st = s.get("staleness")
        stale = f"{st['mean']:.2f} / {st['max']}" if st else "-"
        if target is None:
            lines.append(f"| {run['run_label']} | {s['world_size']} | no entropy floor | - | - | - | {stale} |")
            continue
        c = convergence_of(run, target, last, window)
        shown = f"{c.gap:.4f}" if math.isfinite(c.gap) else f"diverged (non-finite from step {c.nan_at})"
        steps, secs = (str(c.steps), f"{c.seconds:.2f}") if c.steps is not None else ("-", "-")
        lines.append(f"| {run['run_label']} | {s['world_size']} | {shown} | {target:.4f} | {steps} | {secs} | "
                     f"{stale} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Convergence:
    """One run against its target gap: the mean gap of its last steps, the first step (1-based) and summed step
    time at which the trailing-mean gap fell below the target (None: never), the first non-finite step."""

    gap: float
    steps: int | None
    seconds: float | None
    nan_at: int | None


def convergence_of(run: Run, target: float, last: int = 20, window: int = 10) -> Convergence:
    """A run's Convergence: its `window`-step trailing mean gap against `target`, its last `last` steps' gap."""
    rows, floor = run["metrics"], run["summary"]["entropy_floor"]
    assert floor is not None, "target_gaps gives a target only to a run with an entropy floor"
    losses = [r["loss"] for r in rows]
    hit = next((i for i, m in enumerate(trailing_mean(losses, window)) if m - floor < target), None)
    clock = step_clock(rows)
    return Convergence(statistics.fmean(losses[-last:]) - floor, hit + 1 if hit is not None else None,
                       clock[hit] if hit is not None else None,
                       next((r["step"] for r in rows if not math.isfinite(r["loss"])), None))


def seeds_table(runs: list[Run], absolute: float | None = None, last: int = 20,
                stopped: dict[str, list[int]] | None = None) -> str:
    """One Markdown row per group of runs that differ only in seed (psarch/report/seeds.py), where some group has
    two or more: mean ± 95% CI over the seeds of the final gap, steps and time to the target (over the seeds
    that reached it), samples/s, and how many diverged (curves.diverged's rule), never reached the target, or
    stopped before their last step (`stopped`: study_key -> the seeds of the group's failed runs; a run the
    non-finite guard stopped diverged, and is left out of the figures, which it never finished)."""
    stopped = stopped or {}
    groups = seed_groups(runs)
    if all(len(g) < 2 for g in groups):
        return ""
    targets = dict(zip(map(id, runs), target_gaps(runs, absolute)))
    lines = [f"| runs | architecture | N | seeds | gap, mean of last {last} steps | steps to target | "
             "time to target (s) | samples/s | diverged | not reached | stopped (seeds) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for group in groups:
        s, target = group[0]["summary"], targets[id(group[0])]
        seeds = ", ".join(str((r["config"] or {}).get("seed", "?")) for r in group)
        gone = sum(diverged([r["loss"] for r in run["metrics"]]) for run in group)
        rate = interval([run["summary"]["samples_per_s"] for run in group])
        if target is None:
            gap = steps = secs = "no entropy floor"
            missed = "-"
        else:
            cs = [convergence_of(run, target, last) for run in group]
            gap, steps, secs = (str(interval([getattr(c, k) for c in cs]) or "-") for k in ("gap", "steps", "seconds"))
            missed = str(sum(c.steps is None for c in cs))
        names = ", ".join(r["run_label"] for r in group)
        failed = stopped.get(study_key(group[0]), [])
        halted = f"{len(failed)} ({', '.join(map(str, failed))})" if failed else "0"
        lines.append(f"| {names} | {s['label']} | {s['world_size']} | {seeds} | {gap} | {steps} | {secs} | {rate} | "
                     f"{gone} | {missed} | {halted} |")
    return "\n".join(lines)


def default_out(run_dirs: list[str | Path]) -> Path:
    """Where `psarch compare` writes without --out: runs/compare/<the runs' folder names joined by '+'>."""
    names = [Path(d).resolve().name for d in run_dirs]
    joined = "+".join(names)
    if len(joined) > 80:  # a long list: the first name and how many more
        joined = f"{names[0]}+{len(names) - 1}-more"
    return Path("runs") / "compare" / joined


def run_folders(paths: Sequence[str | Path]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The run folders these paths name: a run folder as given; a sweep folder (a folder of run folders, as
    `psarch run` writes for a config with a [sweep]) as its finished points, in the sweep's order (sweep.json's,
    else by name). Also each point left out (not finished) with its status, for the report."""
    folders: list[Path] = []
    left_out: list[tuple[Path, str]] = []
    for path in map(Path, paths):
        if (path / "summary.json").is_file() or not path.is_dir():
            folders.append(path)   # a run folder; anything else load_run refuses in one line
            continue
        listed = path / "sweep.json"
        points = {p["name"]: p["status"] for p in json.loads(listed.read_text())} if listed.is_file() else \
            {d.name: "no run" for d in sorted(path.iterdir()) if (d / "summary.json").is_file()}
        if not points:
            raise FileNotFoundError(f"{path}: neither a run folder (no summary.json) nor a sweep folder (no run "
                                    "folders in it)")
        for name, recorded in points.items():
            summary = path / name / "summary.json"
            status = json.loads(summary.read_text()).get("status", "finished") if summary.is_file() else recorded
            if status == "finished":
                folders.append(path / name)
            else:
                left_out.append((path / name, status))
    return folders, left_out


def stopped_seeds(left_out: list[tuple[Path, str]]) -> dict[str, list[int]]:
    """The seeds of the runs left out (run_folders' (folder, status)) by study_key, from each one's config.json:
    what the Seeds table counts as stopped."""
    out: dict[str, list[int]] = {}
    for folder, _ in left_out:
        config = folder / "config.json"
        if config.is_file():
            cfg = json.loads(config.read_text())
            out.setdefault(config_key(cfg), []).append(cfg.get("seed"))
    return out


def compare(run_dirs: Sequence[str | Path], out: str | Path, target_gap: float | None = None) -> Path:
    """Write report.md and the plots for these runs (run folders, or sweep folders: run_folders) into `out`;
    returns the report's path. `target_gap`: the convergence table's target, absolute (default: the runs'
    convergence_target x the workload's initial gap)."""
    folders, left_out = run_folders(run_dirs)
    runs = [load_run(d) for d in folders]
    if not runs:
        raise ValueError("compare: no runs given")
    name_runs(runs)
    if target_gap is not None and not (math.isfinite(target_gap) and target_gap > 0):
        raise ValueError(f"--target-gap {target_gap:g}: must be a number > 0 (or left out: the runs' "
                         "convergence_target x the workload's initial gap)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = plots.all_plots(runs, out)
    warnings = comparability_warnings(runs)
    text = ["# psarch comparison", ""]
    if warnings:
        text += ["**Warning: these runs are not directly comparable.**", ""] + [f"- {w}" for w in warnings] + [""]
    text += [table(runs), "", f"Runs: by folder (or config `label`). {rate_note(runs)} Memory: rank 0's model "
             "states (params + grads + optimizer incl. fp32 masters). Traffic: mean over workers; native collectives "
             "are modelled, not measured. Serving nodes' memory (a PS's servers) and the whole system's: memory.png. "
             "Predictions: theory.predict on each run's config.", ""]
    forks = [f"- {r['run_label']} started from {f['path']} (step {f['step']}, config sha256 "
             f"{f['config_sha256'][:12]})" for r in runs if (f := (r["config"] or {}).get("started_from"))]
    text += forks + [""] if forks else []
    text += ["Left out of the sweep folders given (not finished):", ""] + [f"- {folder}: {status}" for folder, status in left_out] + [""] \
        if left_out else []
    sparse = [r for r in runs if is_sparse_run(r)]
    if sparse:
        figures.append(embedding_scaling(sparse, out))
        text += ["## Embedding tables", "", sparse_table(sparse), "", "Sent: mean over workers per step. Embedding "
                 "held: the busiest worker's rows (PS: its peak; ddp sharded: its shard; other backends replicate the "
                 "whole tables). Unique ids: distinct ids of one worker's batch over all tables, mean over steps, "
                 "beside their expectation under the Zipf law. Final gap: last step's loss minus the known floor.", ""]
    study = seeds_table(runs, target_gap, stopped=stopped_seeds(left_out))
    if study:
        text += ["## Seeds", "", study, "", "Runs that differ only in their seed, as one study: mean ± the half-width "
                 "of the 95% confidence interval (Student's t over the seeds; n: the seeds that have the figure, so "
                 "steps and time to target count only the seeds that reached it). Diverged: a loss not finite, or "
                 "the curve ends above twice its start.", ""]
    ranked = [r for r in runs if has_per_rank(r)]
    if ranked:
        text += ["## Per rank", "", rank_table(ranked), "", "For model-parallel runs, whose ranks hold different "
                 "parts of the model: each rank's model states, bytes per step on its link (sent and received) and "
                 "the figures its backend predicts per rank, measured beside predicted. Idle fraction: the share "
                 "of the step's pipeline phase a stage waited, median over steps; activations held: the bytes "
                 "autograd kept for backward at a stage's peak; block activation bytes: what a tensor shard's "
                 "transformer blocks keep for backward in a step (psarch.activations; measured where "
                 "backend.measure_activations is on), each counted from the saved tensors.", "",
                 "## Links", "", links_table(ranked), "", "Sent per link: one rank's link, mean over ranks; by "
                 "operation: rank 0's, per step.", ""]
    conv = convergence(runs, target_gap)
    if conv:
        initial = (" (the first step's loss less the floor, of a run of that workload from step 0, in lockstep "
                   "where there is one)") if target_gap is None else ""
        text += ["## Convergence", "", conv, "", "Steps and time (summed step times) until the 10-step mean gap to "
                 f"the entropy floor first fell below the target gap, {target_words(target_gap, target_fraction(runs))}"
                 f"{initial}.", ""]
    text += [f"![{name}]({name}.png)" for name in figures]
    report = out / "report.md"
    report.write_text("\n".join(text) + "\n")
    return report
