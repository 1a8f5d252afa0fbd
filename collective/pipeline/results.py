"""The table of experiments/model_parallel.toml's README section, from a sweep's run folders.

    python -m collective.pipeline.results runs/model_parallel [--out pipeline.md]

One row per finished run: step time, each stage's idle fraction measured | predicted (pipeline runs), the
most activations a stage held measured | predicted, the busiest link's bytes per step measured | predicted,
and model states per rank (the fullest); on loopback and on the emulated cluster.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from psarch.units import fmt_bytes


def _finished(folder: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(folder.glob("*/summary.json")):
        s = json.loads(path.read_text())
        if s.get("status") == "finished":
            runs.append(s)
    return runs


def _pct(values: list[float]) -> str:
    return " ".join(f"{100 * v:.0f}" for v in values)


def row(s: dict[str, Any]) -> str:
    """One Markdown row of a finished run's summary."""
    per = s["predicted"].get("per_rank")
    extra = s.get("extra") or {}
    links = s["traffic"]["per_rank"]
    sent = max(t["sent_per_step"] for t in links)
    modelled = "*" if links[0].get("modelled") else ""
    if per:
        idle = f"{_pct(extra.get('idle_fraction') or [])} \\| {100 * per[0]['idle_fraction']:.0f}"
        held = extra.get("activations_held") or [0]
        act = f"{fmt_bytes(max(held))} \\| {fmt_bytes(max(r.get('activations_held', 0) for r in per))}"
        pred_sent = max(r["sent"] for r in per)
    else:
        idle = act = "-"
        pred_sent = s["predicted"]["traffic_per_step"]["worker_sent"]
    states = max(m["total"] for m in s["memory"]["per_rank"])
    place = "cluster" if (s.get("cluster") or {}).get("emulated") else "loopback"
    return (f"| {s['label']} | {place} | {s['step_time_s'] * 1e3:.0f} | {idle} | {act} | "
            f"{fmt_bytes(sent)}{modelled} \\| {fmt_bytes(pred_sent)} | {fmt_bytes(states)} |")


def table(runs: list[dict[str, Any]]) -> str:
    head = ("| architecture | where | step ms | idle % per stage measured \\| predicted | activations held (fullest "
            "stage) measured \\| predicted | busiest link sent/step measured \\| predicted | model states (fullest "
            "rank) |")
    order = sorted(runs, key=lambda s: ((s.get("cluster") or {}).get("emulated", False), s["backend"], s["label"]))
    return "\n".join([head, "|---|---|---:|---|---|---|---:|"] + [row(s) for s in order])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--out", help="write the table here too")
    a = ap.parse_args(argv)
    text = table(_finished(Path(a.folder))) + "\n"
    print(text, end="")
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
