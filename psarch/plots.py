"""The comparison plots (matplotlib, written as PNG files)."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from psarch.runs import label, server_received_per_step, short_names, step_clock, trailing_mean, worker_sent_per_step  # noqa: E402

CATEGORIES = ("params", "grads", "optimizer", "buffers")


def _save(fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    plt.close(fig)
    return name


def _legend(ax: Any) -> None:
    """One legend entry per label (bars repeat their labels run after run)."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7)


def _styles(runs: list[dict]) -> list[tuple[str, dict[str, Any]]]:
    """(legend name, line style) per run: one colour per configuration, one line style per N."""
    names = short_names(runs)
    worlds = sorted({r["summary"]["world_size"] for r in runs})
    configs: list[str] = []
    out = []
    for run, name in zip(runs, names):
        n = run["summary"]["world_size"]
        config = re.sub(r"-?world_size\d+", "", name) or name
        if config not in configs:
            configs.append(config)
        text = name + (f" N={n}" if f"world_size{n}" not in name else "")
        out.append((text, dict(color=f"C{configs.index(config) % 10}", ls=("-", "--", ":", "-.")[worlds.index(n) % 4],
                               lw=1.2)))
    return out


def loss_curves(runs: list[dict], out: Path) -> str:
    """Every run on one chart, against step and against wall-clock time: one colour per configuration,
    one line style per N; the y range ends above the runs' starting loss, and a run that went past it
    (or to inf/nan) is marked diverged in the legend."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    steps_max = max((len(r["metrics"]) for r in runs), default=1)
    window = max(1, steps_max // 40)
    top = 0.0
    for run in runs:
        first = [r["loss"] for r in run["metrics"][:window] if math.isfinite(r["loss"])]
        top = max(top, max(first, default=0.0))
    floor = runs[0]["summary"].get("entropy_floor")
    for run, (name, style) in zip(runs, _styles(runs)):
        rows = run["metrics"]
        clock = step_clock(rows)
        losses = trailing_mean([r["loss"] for r in rows], window)
        diverged = any(not math.isfinite(v) or v > 1.1 * top for v in losses)
        a.plot([r["step"] for r in rows], losses, label=name + (" (diverged)" if diverged else ""), **style)
        b.plot(clock, losses, **style)
    for ax, xlabel in ((a, "step"), (b, "wall-clock time of steps (s)")):
        if floor is not None:
            ax.axhline(floor, color="k", ls=":", lw=1, label="entropy floor" if ax is a else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"loss ({window}-step mean)" if window > 1 else "loss")
        if top > 0:
            bottom = floor if floor is not None else min(
                (r["loss"] for run in runs for r in run["metrics"] if math.isfinite(r["loss"])), default=0.0)
            ax.set_ylim(bottom - 0.05 * (top - bottom), 1.1 * top - 0.1 * bottom)
    a.legend(fontsize=6, ncol=2 if len(runs) > 10 else 1)
    return _save(fig, out, "loss")


def memory(runs: list[dict], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(runs) + 2), 4.5))
    colors = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green", "buffers": "tab:gray"}
    for i, run in enumerate(runs):
        m = run["summary"]["memory"]["per_rank"][0]
        p = run["summary"]["predicted"]["memory_per_rank"]
        bottom = bottom_p = 0.0
        for c in CATEGORIES:
            mc, pc = m.get(c, 0) / 2**20, p.get(c, 0) / 2**20
            ax.bar(i - 0.2, mc, 0.38, bottom=bottom, color=colors[c], label=c if mc else None)
            ax.bar(i + 0.2, pc, 0.38, bottom=bottom_p, color=colors[c], alpha=0.45, hatch="//",
                   label=f"{c} (formula)" if pc else None)
            bottom += mc
            bottom_p += pc
    ax.set_xticks(range(len(runs)), [label(r) for r in runs], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("MiB per rank (rank 0): measured | formula")
    _legend(ax)
    return _save(fig, out, "memory")


def traffic(runs: list[dict], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(runs) + 2), 4.5))
    for i, run in enumerate(runs):
        s = run["summary"]
        sent = worker_sent_per_step(s)
        ax.bar(i - 0.3, sent / 2**20, 0.2, color="tab:blue", label="worker sent/step" if i == 0 else None)
        ax.bar(i - 0.1, s["predicted"]["traffic_per_step"]["worker_sent"] / 2**20, 0.2, color="tab:blue",
               alpha=0.45, hatch="//", label="worker (formula)" if i == 0 else None)
        recv = server_received_per_step(s)
        if recv is not None:
            ax.bar(i + 0.1, recv / 2**20, 0.2, color="tab:red", label="server received/step")
            ax.bar(i + 0.3, s["predicted"]["traffic_per_step"].get("server_received", 0) / 2**20, 0.2,
                   color="tab:red", alpha=0.45, hatch="//", label="server (formula)")
    ax.set_xticks(range(len(runs)), [label(r) for r in runs], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("MiB per step")
    _legend(ax)
    return _save(fig, out, "traffic")


def throughput(runs: list[dict], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        s = run["summary"]
        name = s["backend"] + (f" {s['variant']}" if s.get("variant") else "")
        series.setdefault(name, []).append((s["world_size"], s["samples_per_s"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    ax.set_xlabel("workers N")
    ax.set_ylabel("samples/s")
    ax.legend(fontsize=7)
    return _save(fig, out, "throughput")


def staleness(runs: list[dict], out: Path) -> str | None:
    """Each async run's staleness distribution as a line (fraction of its updates), so that runs with
    different numbers of updates compare; the x range ends where every run has < 1% of its updates
    (the legend gives each maximum)."""
    hists = [(name, style, r["summary"]["staleness"]) for r, (name, style) in zip(runs, _styles(runs))
             if r["summary"].get("staleness")]
    if not hists:
        return None
    fig, ax = plt.subplots(figsize=(9, 5))
    right = 1
    for name, style, h in hists:
        hist = {int(k): v for k, v in h.get("histogram", h).items()}
        total = sum(hist.values()) or 1
        xs = list(range(max(hist) + 1))
        fracs = [hist.get(x, 0) / total for x in xs]
        right = max(right, max((x for x, f in zip(xs, fracs) if f >= 1e-2), default=1))
        ax.plot(xs, fracs, marker=".", ms=3, label=f"{name} (mean {h.get('mean', 0):.2f}, max {max(hist)})", **style)
    ax.set_xlim(-0.5, right + 0.5)
    ax.set_xlabel("staleness (server version at apply - version the gradient was computed on)")
    ax.set_ylabel("fraction of updates")
    ax.legend(fontsize=6)
    return _save(fig, out, "staleness")


def all_plots(runs: list[dict[str, Any]], out: Path) -> list[str]:
    names = [loss_curves(runs, out), memory(runs, out), traffic(runs, out), throughput(runs, out)]
    s = staleness(runs, out)
    return names + ([s] if s else [])
