"""The per-rank section of `psarch compare`, for model-parallel runs (theory's Prediction.per_rank: a
pipeline's stages, a tensor run's shards): each rank's model states and link bytes beside its own prediction,
and every figure the backend predicts per rank and also measured (summary.json's `extra`, one entry per rank,
under the same name): the idle fraction (the bubble) and activations held of a stage, the blocks' activation
bytes of a shard. Figures named *_fraction are shown as percentages, the others as bytes."""
from __future__ import annotations

from typing import Any

from psarch.units import fmt_bytes
from psarch.report.runs import Run

OWN_COLUMNS = {"memory", "sent", "received"}   # shown in every row already


def has_per_rank(run: Run) -> bool:
    return bool(run["summary"]["predicted"].get("per_rank"))


def _figures(run: Run) -> list[str]:
    """The per-rank figures theory predicts that the run also measured."""
    s = run["summary"]
    predicted = s["predicted"]["per_rank"][0]
    return [k for k in predicted if k not in OWN_COLUMNS and k in (s.get("extra") or {})]


def _show(key: str, value: Any) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if key.endswith("_fraction") else fmt_bytes(value)


def rank_table(runs: list[Run]) -> str:
    """One row per rank of every run with per-rank predictions, in Markdown."""
    keys = list(dict.fromkeys(k for run in runs for k in _figures(run)))
    head = ("| run | architecture | rank | model states measured \\| predicted | sent/step measured \\| predicted "
            "| received/step measured \\| predicted |" + "".join(f" {k.replace('_', ' ')} measured \\| predicted |"
                                                              for k in keys))
    lines = [head, "|" + "---|" * (6 + len(keys))]
    for run in runs:
        s = run["summary"]
        extra = s.get("extra") or {}
        for m, t in zip(s["memory"]["per_rank"], s["traffic"]["per_rank"]):
            r = m["rank"]
            pred = s["predicted"]["per_rank"][r]
            modelled = " (modelled)" if t.get("modelled") else ""
            cells = [f"{fmt_bytes(m['total'])} \\| {fmt_bytes(pred['memory']['total'])}",
                     f"{fmt_bytes(t['sent_per_step'])}{modelled} \\| {fmt_bytes(pred['sent'])}",
                     f"{fmt_bytes(t['received_per_step'])}{modelled} \\| {fmt_bytes(pred['received'])}"]
            cells += [f"{_show(k, extra[k][r] if k in extra and r < len(extra[k]) else None)} \\| "
                      f"{_show(k, pred.get(k))}" for k in keys]
            name = run.get("run_label", s["name"])
            lines.append(f"| {name} | {s['label']} | {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
