"""The sparse-embedding columns of `psarch compare` for dlrm runs (issue 11): bytes per worker per step,
step time, embedding bytes one worker holds against the tables' size, distinct ids per step and loss gap."""
from __future__ import annotations

import statistics
from pathlib import Path

from psarch import theory
from psarch.report.runs import Run, run_config, worker_sent_per_step
from psarch.units import fmt_bytes

# summary.json extra keys holding a worker's embedding bytes: the PS row worker's peak, ddp sharded's shard
HELD_KEYS = ("embedding_bytes_held_peak", "embedding_bytes")


def is_sparse_run(run: Run) -> bool:
    """A run of the dlrm workload (embedding tables), the only one these columns describe."""
    return (run["config"].get("workload") or {}).get("model") == "dlrm"


def measured_unique_ids(run: Run) -> float | None:
    """Distinct ids one worker's batch read per step (all tables), mean over steps and workers; None when
    the backend does not report them (ddp with dense tables)."""
    per = [w.get("extra", {}).get("unique_ids") for r in run["metrics"] for w in r.get("workers", [r])]
    found = [u for u in per if u is not None]
    return statistics.fmean(found) if found else None


def embedding_held(run: Run) -> tuple[float, float]:
    """(bytes of embedding rows the busiest worker held, bytes of the whole tables in fp32). Backends that
    report nothing (ddp dense and rows, torch_ddp) replicate the model, so each rank holds the whole tables."""
    table = float(theory.table_params(run_config(run)) * 4)
    extra = run["summary"].get("extra") or {}
    for key in HELD_KEYS:
        if extra.get(key):
            return float(max(extra[key])), table
    return table, table


def sparse_table(runs: list[Run]) -> str:
    """One Markdown row per dlrm run: rows x Zipf, bytes, step time, embedding bytes held, ids and gap."""
    lines = ["| run | architecture | rows | zipf | sent/worker/step measured \\| predicted | step time (ms) | "
             "embedding held/worker \\| table | unique ids/step measured \\| expected | final gap |",
             "|" + "---|" * 9]
    for run in runs:
        s, cfg = run["summary"], run_config(run)
        held, table = embedding_held(run)
        u = measured_unique_ids(run)
        modelled = " (modelled)" if s["traffic"]["per_rank"][0].get("modelled") else ""
        gap = f"{s['gap']:.4f}" if s.get("gap") is not None else "-"
        lines.append(
            f"| {run['run_label']} | {s['label']} | {cfg.workload.dlrm.rows} | "
            f"{cfg.workload.clicks.zipf:g} | {fmt_bytes(worker_sent_per_step(s))}{modelled} \\| "
            f"{fmt_bytes(s['predicted']['traffic_per_step']['worker_sent'])} | {s['step_time_s'] * 1e3:.1f} | "
            f"{fmt_bytes(held)} \\| {fmt_bytes(table)} | {'-' if u is None else f'{u:.0f}'} \\| "
            f"{theory.expected_unique_ids(cfg):.0f} | {gap} |")
    return "\n".join(lines)


def series(runs: list[Run]) -> dict[float, dict[str, list[tuple[int, float, float, float]]]]:
    """Per Zipf exponent, per architecture (its label), the points (rows, bytes sent per worker per step
    measured, predicted, step time in s) sorted by table rows: what embedding_scaling plots."""
    out: dict[float, dict[str, list[tuple[int, float, float, float]]]] = {}
    for run in runs:
        s, cfg = run["summary"], run_config(run)
        variant = s["label"]
        point = (cfg.workload.dlrm.rows, worker_sent_per_step(s), s["predicted"]["traffic_per_step"]["worker_sent"],
                 s["step_time_s"])
        out.setdefault(cfg.workload.clicks.zipf, {}).setdefault(variant, []).append(point)
    for by_variant in out.values():
        for points in by_variant.values():
            points.sort()
    return dict(sorted(out.items()))


def decade(values: list[float]) -> tuple[float, float]:
    """Limits of a log axis holding these positive values and spanning at least a factor of 10, so that a few
    bytes between measured and predicted never fill a panel as if they were a gap."""
    lo, hi = min(values), max(values)
    mid = (lo * hi) ** 0.5
    return min(lo / 1.5, mid / 10**0.5), max(hi * 1.5, mid * 10**0.5)


def embedding_scaling(runs: list[Run], out: Path) -> str:
    """embedding_scaling.png: bytes per worker per step (measured solid, predicted dashed) and step time
    against table rows, one column per Zipf exponent, one colour per variant; returns the name."""
    import matplotlib.pyplot as plt

    from psarch.report.style import legend_beside, save

    data = series(runs)
    variants = sorted({v for by in data.values() for v in by})
    fig, axes = plt.subplots(2, len(data), figsize=(4.6 * len(data) + 2.0, 7), squeeze=False, sharex=True,
                             layout="constrained")
    for col, (zipf, by_variant) in enumerate(data.items()):
        top, bottom = axes[0][col], axes[1][col]
        for variant, points in by_variant.items():
            colour = f"C{variants.index(variant) % 10}"
            rows = [p[0] for p in points]
            top.plot(rows, [p[1] for p in points], "o-", color=colour, label=variant)
            top.plot(rows, [p[2] for p in points], "x--", color=colour, alpha=0.6)
            bottom.plot(rows, [p[3] for p in points], "o-", color=colour, label=variant)
        sent = [x for points in by_variant.values() for p in points for x in p[1:3] if x > 0]
        times = [p[3] for points in by_variant.values() for p in points if p[3] > 0]
        top.set(xscale="log", yscale="log", title=f"Zipf {zipf:g}", ylabel="bytes sent / worker / step")
        bottom.set(xscale="log", yscale="log", xlabel="rows per table", ylabel="step time (s)")
        for ax, values in ((top, sent), (bottom, times)):
            if values:
                ax.set_ylim(*decade(values))
    legend = legend_beside(fig, list(axes.flat))   # beside the panels, never on the data
    legend.set_title("solid measured, dashed predicted", prop={"size": 7})
    return save(fig, out, "embedding_scaling")
