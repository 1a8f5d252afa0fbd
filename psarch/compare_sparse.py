"""The sparse-embedding columns of `psarch compare` for dlrm runs (issue 11): bytes per worker per step,
step time, embedding bytes one worker holds against the tables' size, distinct ids per step and loss gap."""
from __future__ import annotations

import statistics
from typing import Any

from psarch import theory
from psarch.runs import run_config, worker_sent_per_step
from psarch.units import fmt_bytes

# summary.json extra keys holding a worker's embedding bytes: the PS row worker's peak, ddp sharded's shard
HELD_KEYS = ("embedding_bytes_held_peak", "embedding_bytes")


def is_sparse_run(run: dict[str, Any]) -> bool:
    """A run of the dlrm workload (embedding tables), the only one these columns describe."""
    return (run["config"].get("workload") or {}).get("model") == "dlrm"


def measured_unique_ids(run: dict[str, Any]) -> float | None:
    """Distinct ids one worker's batch read per step (all tables), mean over steps and workers; None when
    the backend does not report them (ddp with dense tables)."""
    per = [w.get("extra", {}).get("unique_ids") for r in run["metrics"] for w in r.get("workers", [r])]
    per = [u for u in per if u is not None]
    return statistics.fmean(per) if per else None


def embedding_held(run: dict[str, Any]) -> tuple[float, float]:
    """(bytes of embedding rows the busiest worker held, bytes of the whole tables in fp32). Backends that
    report nothing (ddp dense and rows, torch_ddp) replicate the model, so each rank holds the whole tables."""
    table = float(theory.table_params(run_config(run)) * 4)
    extra = run["summary"].get("extra") or {}
    for key in HELD_KEYS:
        if extra.get(key):
            return float(max(extra[key])), table
    return table, table


def sparse_table(runs: list[dict[str, Any]]) -> str:
    """One Markdown row per dlrm run: rows x Zipf, bytes, step time, embedding bytes held, ids and gap."""
    lines = ["| run | backend | variant | rows | zipf | sent/worker/step measured \\| predicted | step time (ms) | "
             "embedding held/worker \\| table | unique ids/step measured \\| expected | final gap |",
             "|" + "---|" * 10]
    for run in runs:
        s, cfg = run["summary"], run_config(run)
        held, table = embedding_held(run)
        u = measured_unique_ids(run)
        modelled = " (modelled)" if s["traffic"]["per_rank"][0].get("modelled") else ""
        gap = f"{s['gap']:.4f}" if s.get("gap") is not None else "-"
        lines.append(
            f"| {s['name']} | {s['backend']} | {s.get('variant') or '-'} | {cfg.workload.dlrm.rows} | "
            f"{cfg.workload.clicks.zipf:g} | {fmt_bytes(worker_sent_per_step(s))}{modelled} \\| "
            f"{fmt_bytes(s['predicted']['traffic_per_step']['worker_sent'])} | {s['step_time_s'] * 1e3:.1f} | "
            f"{fmt_bytes(held)} \\| {fmt_bytes(table)} | {'-' if u is None else f'{u:.0f}'} \\| "
            f"{theory.expected_unique_ids(cfg):.0f} | {gap} |")
    return "\n".join(lines)
