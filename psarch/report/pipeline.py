"""The table of the model_parallel study, from sweeps' run folders.

    psarch report pipeline runs/model_parallel runs/model_parallel_cluster [--out pipeline.md]

One row per finished run of the folders given: step time, each stage's idle fraction measured | predicted
(pipeline runs), the activations of the fullest rank measured | predicted (a pipeline stage's held at its
peak; a tensor shard's blocks'), the busiest link's bytes per step measured | predicted, and model states
per rank (the fullest); on loopback and on the emulated cluster.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from collective.tensor.theory import BLOCK_ACTIVATIONS
from psarch.records import Summary
from psarch.units import fmt_bytes

ACTIVATIONS = ("activations_held", BLOCK_ACTIVATIONS)   # the per-rank activation figures, pipeline's and tensor's


def _finished(folder: Path) -> list[Summary]:
    runs = []
    for path in sorted(folder.glob("*/summary.json")):
        s = json.loads(path.read_text())
        if s.get("status") == "finished":
            runs.append(s)
    return runs


def _pct(values: list[float]) -> str:
    return " ".join(f"{100 * v:.0f}" for v in values)


def row(s: Summary) -> str:
    """One Markdown row of a finished run's summary."""
    per = s["predicted"].get("per_rank")
    extra = s.get("extra") or {}
    links = s["traffic"]["per_rank"]
    sent = max(t["sent_per_step"] for t in links)
    modelled = "*" if links[0].get("modelled") else ""
    idle = act = "-"
    if per and "idle_fraction" in per[0]:
        idle = f"{_pct(extra.get('idle_fraction') or [])} \\| {100 * per[0]['idle_fraction']:.0f}"
    for key in ACTIVATIONS:
        if per and key in per[0]:
            held = extra.get(key)
            act = (f"{fmt_bytes(max(held)) if held else '- (not measured)'} \\| "
                   f"{fmt_bytes(max(r[key] for r in per))}")
    pred_sent = max(r["sent"] for r in per) if per else s["predicted"]["traffic_per_step"]["worker_sent"]
    states = max(m["total"] for m in s["memory"]["per_rank"])
    place = "cluster" if (s.get("cluster") or {}).get("emulated") else "loopback"
    return (f"| {s['label']} | {place} | {s['step_time_s'] * 1e3:.0f} | {idle} | {act} | "
            f"{fmt_bytes(sent)}{modelled} \\| {fmt_bytes(pred_sent)} | {fmt_bytes(states)} |")


def table(runs: list[Summary]) -> str:
    head = ("| architecture | where | step ms | idle % per stage measured \\| predicted | activations (fullest "
            "rank) measured \\| predicted | busiest link sent/step measured \\| predicted | model states (fullest "
            "rank) |")
    order = sorted(runs, key=lambda s: ((s.get("cluster") or {}).get("emulated", False), s["backend"], s["label"]))
    return "\n".join([head, "|---|---|---:|---|---|---|---:|"] + [row(s) for s in order])


def main(argv: list[str] | None = None) -> int:
    """`psarch report pipeline FOLDER... [--out FILE]`: print the table (and write it to FILE)."""
    ap = argparse.ArgumentParser(prog="psarch report pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--out", help="write the table here too")
    a = ap.parse_args(argv)
    text = table([s for folder in a.folders for s in _finished(Path(folder))]) + "\n"
    print(text, end="")
    if a.out:
        Path(a.out).write_text(text)
    return 0
