"""The activations-and-links section of `psarch compare`, for runs whose backend predicts the activations its
transformer blocks keep (Prediction.activations: model-parallel backends): the blocks' activations per rank,
measured (backend.measure_activations) beside predicted, and the bytes each rank's link carries per step,
split by operation (for tensor parallelism the activations' all-reduces within a tensor-parallel group, the
loss's gather and the gradients' all-reduce across replicas), beside theory's total."""
from __future__ import annotations

from typing import Any

from psarch.runs import worker_sent_per_step
from psarch.units import fmt_bytes

MEASURED = "block_activation_bytes"   # the summary's extra key (one entry per rank) a backend measures them under


def predicts_activations(run: dict[str, Any]) -> bool:
    return "block_activations_per_rank" in run["summary"]["predicted"]


def ops_per_step(summary: dict[str, Any], rank: int = 0) -> dict[str, float]:
    """Bytes rank `rank` sent per step by operation: its run totals over the steps, set-up and export left out."""
    ops = summary["traffic"]["per_rank"][rank].get("ops", {})
    steps = max(1, summary["steps"])
    return {op: o["sent"] / steps for op, o in ops.items() if not op.startswith("export_") and o["sent"]}


def links_table(runs: list[dict[str, Any]]) -> str:
    """One row per run that predicts activations, in Markdown."""
    lines = ["| run | architecture | N | blocks' activations/rank measured \\| predicted | sent/link/step measured "
             "\\| predicted | by operation (rank 0) |", "|---|---|---|---|---|---|"]
    for run in filter(predicts_activations, runs):
        s = run["summary"]
        measured = (s.get("extra") or {}).get(MEASURED)
        predicted = s["predicted"]["block_activations_per_rank"]
        shown = fmt_bytes(measured[0]) if measured else "- (not measured)"
        modelled = " (modelled)" if s["traffic"]["per_rank"][0].get("modelled") else ""
        ops = ", ".join(f"{op} {fmt_bytes(v)}" for op, v in ops_per_step(s).items()) or "-"
        lines.append(f"| {run.get('run_label', s['name'])} | {s['label']} | {s['world_size']} | {shown} \\| {fmt_bytes(predicted)} | "
                     f"{fmt_bytes(worker_sent_per_step(s))}{modelled} \\| "
                     f"{fmt_bytes(s['predicted']['traffic_per_step']['worker_sent'])} | {ops} |")
    return "\n".join(lines)
