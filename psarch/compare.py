"""`psarch compare RUN_DIR ... [--out DIR]`: one table of runs, measured beside predicted, and plots."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from psarch import plots
from psarch.compare_ranks import has_per_rank, rank_table
from psarch.compare_sparse import embedding_scaling, is_sparse_run, sparse_table
from psarch.runs import (label, load_run, predicted_rank0_memory, predicted_worker_sent, server_received_per_step,
                         step_clock, trailing_mean, worker_sent_per_step)
from psarch.units import fmt_bytes


def comparability_warnings(runs: list[dict[str, Any]]) -> list[str]:
    """Runs compare fairly only on the same workload, data and global batch."""
    warnings = []

    def key(run: dict) -> dict:
        c, s = run["config"], run["summary"]
        w = c.get("workload", {})
        return {"workload": s.get("workload"), "params": s.get("params"), "global_batch": s.get("global_batch"),
                "seq_len": w.get("seq_len"), "data": w.get("markov") if w.get("data") == "markov" else w.get("text"),
                "seed": c.get("seed")}

    ref = key(runs[0])
    for run in runs[1:]:
        k = key(run)
        for field in ref:
            if k[field] != ref[field]:
                warnings.append(f"{label(run)} differs from {label(runs[0])} in {field}: "
                                f"{json.dumps(k[field])} vs {json.dumps(ref[field])}")
    return warnings


def table(runs: list[dict[str, Any]]) -> str:
    """The comparison table, in Markdown; rank 0's memory and the mean worker's traffic."""
    head = ("| run | architecture | N | samples/s | step time (ms) | final loss (last step) | gap | model states/rank "
            "measured \\| predicted | sent/worker/step measured \\| predicted | server recv/step measured \\| predicted "
            "| peak memory |")
    lines = [head, "|" + "---|" * 11]
    for run in runs:
        s = run["summary"]
        m0 = s["memory"]["per_rank"][0]
        pm = predicted_rank0_memory(s)
        sent = worker_sent_per_step(s)
        modelled = " (modelled)" if s["traffic"]["per_rank"][0].get("modelled") else ""
        pt = s["predicted"]["traffic_per_step"]
        recv = server_received_per_step(s)
        srv = f"{fmt_bytes(recv)} \\| {fmt_bytes(pt.get('server_received'))}" if recv is not None else "-"
        gap = f"{s['gap']:.4f}" if s.get("gap") is not None else "-"
        lines.append(f"| {s['name']} | {s['label']} | {s['world_size']} | "
                     f"{s['samples_per_s']:.1f} | {s['step_time_s'] * 1e3:.2f} | {s['final_loss']:.4f} | {gap} | "
                     f"{fmt_bytes(m0['total'])} \\| {fmt_bytes(pm)} | {fmt_bytes(sent)}{modelled} \\| {fmt_bytes(predicted_worker_sent(s))} | {srv} | "
                     f"{fmt_bytes(m0.get('peak'))} |")
    return "\n".join(lines)


def convergence(runs: list[dict[str, Any]], target_gap: float = 0.25, last: int = 20, window: int = 10) -> str:
    """How fast each run converged, in Markdown: the gap to the entropy floor as the mean of the last
    `last` steps (one small batch's loss is too noisy to rank runs by), and the first step and wall-clock
    time of steps at which the `window`-step mean gap fell below `target_gap`. Empty without a floor."""
    lines = [f"| run | N | gap, mean of last {last} steps | steps to gap < {target_gap:g} | "
             f"time to gap < {target_gap:g} (s) | staleness mean / max |", "|---|---|---|---|---|---|"]
    for run in runs:
        s, rows = run["summary"], run["metrics"]
        floor = s.get("entropy_floor")
        if floor is None or not rows:
            return ""
        losses = [r["loss"] for r in rows]
        gap = statistics.fmean(losses[-last:]) - floor
        clock = step_clock(rows)
        hit = next((i for i, m in enumerate(trailing_mean(losses, window)) if m - floor < target_gap), None)
        nan_at = next((r["step"] for r in rows if not math.isfinite(r["loss"])), None)
        shown = f"{gap:.4f}" if math.isfinite(gap) else f"diverged (non-finite from step {nan_at})"
        st = s.get("staleness")
        steps, secs = (str(hit + 1), f"{clock[hit]:.2f}") if hit is not None else ("-", "-")
        stale = f"{st['mean']:.2f} / {st['max']}" if st else "-"
        lines.append(f"| {s['name']} | {s['world_size']} | {shown} | {steps} | {secs} | {stale} |")
    return "\n".join(lines)


def default_out(run_dirs: list[str | Path]) -> Path:
    """Where `psarch compare` writes without --out: runs/compare/<the runs' folder names joined by '+'>."""
    names = [Path(d).resolve().name for d in run_dirs]
    joined = "+".join(names)
    if len(joined) > 80:  # a long list: the first name and how many more
        joined = f"{names[0]}+{len(names) - 1}-more"
    return Path("runs") / "compare" / joined


def compare(run_dirs: list[str | Path], out: str | Path, target_gap: float = 0.25) -> Path:
    """Write report.md and the plots for these runs into `out`; returns the report's path."""
    runs = [load_run(Path(d)) for d in run_dirs]
    if not runs:
        raise ValueError("compare: no runs given")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = plots.all_plots(runs, out)
    warnings = comparability_warnings(runs)
    text = ["# psarch comparison", ""]
    if warnings:
        text += ["**Warning: these runs are not directly comparable.**", ""] + [f"- {w}" for w in warnings] + [""]
    text += [table(runs), "", "Memory: rank 0's model states (params + grads + optimizer incl. fp32 masters). "
             "Traffic: mean over workers; native collectives are modelled, not measured. PS servers' memory and the "
             "whole system's (workers + servers): memory.png. Predictions: theory.predict on each run's config.", ""]
    sparse = [r for r in runs if is_sparse_run(r)]
    if sparse:
        figures.append(embedding_scaling(sparse, out))
        text += ["## Embedding tables", "", sparse_table(sparse), "", "Sent: mean over workers per step. Embedding "
                 "held: the busiest worker's rows (PS: its peak; ddp sharded: its shard; other backends replicate the "
                 "whole tables). Unique ids: distinct ids of one worker's batch over all tables, mean over steps, "
                 "beside their expectation under the Zipf law. Final gap: last step's loss minus the known floor.", ""]
    ranked = [r for r in runs if has_per_rank(r)]
    if ranked:
        text += ["## Per rank", "", rank_table(ranked), "", "For runs whose ranks differ by design (a pipeline's "
                 "stages): each rank's model states, bytes per step on its link (sent and received) and the "
                 "figures its backend predicts per rank, measured beside predicted (idle fraction: the share of "
                 "the step's pipeline phase a rank waited, median over steps; activations held: the bytes "
                 "autograd kept for backward at the step's peak, counted from the saved tensors).", ""]
    conv = convergence(runs, target_gap)
    if conv:
        text += ["## Convergence", "", conv, "", f"Steps and time (summed step times) until the 10-step mean "
                 f"gap to the entropy floor first fell below {target_gap:g}.", ""]
    text += [f"![{name}]({name}.png)" for name in figures]
    report = out / "report.md"
    report.write_text("\n".join(text) + "\n")
    return report
