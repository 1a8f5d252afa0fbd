"""The links section of `psarch compare`, for model-parallel runs (theory's Prediction.per_rank): the bytes one
rank's link carries per step beside theory's, and rank 0's split by operation (for tensor parallelism the
activations' all-reduces within a tensor-parallel group, the loss's gather and the gradients' all-reduce across
replicas; for a pipeline the activations and their gradients between stages and the stage all-reduce)."""
from __future__ import annotations


from psarch.records import Summary
from psarch.report.runs import Run, predicted_worker_sent, worker_sent_per_step
from psarch.units import fmt_bytes


def ops_per_step(summary: Summary, rank: int = 0) -> dict[str, float]:
    """Bytes rank `rank` sent per step by operation: its run totals over the steps, set-up and export left out."""
    ops = summary["traffic"]["per_rank"][rank].get("ops", {})
    steps = max(1, summary["steps"])
    return {op: o["sent"] / steps for op, o in ops.items() if not op.startswith("export_") and o["sent"]}


def links_table(runs: list[Run]) -> str:
    """One row per run, in Markdown."""
    lines = ["| run | architecture | N | sent/link/step measured \\| predicted | by operation (rank 0) |",
             "|---|---|---|---|---|"]
    for run in runs:
        s = run["summary"]
        modelled = " (modelled)" if s["traffic"]["per_rank"][0].get("modelled") else ""
        ops = ", ".join(f"{op} {fmt_bytes(v)}" for op, v in ops_per_step(s).items()) or "-"
        lines.append(f"| {run.get('run_label', s['name'])} | {s['label']} | {s['world_size']} | "
                     f"{fmt_bytes(worker_sent_per_step(s))}{modelled} \\| {fmt_bytes(predicted_worker_sent(s))} | "
                     f"{ops} |")
    return "\n".join(lines)
