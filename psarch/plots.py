"""The comparison plots (matplotlib, written as PNG files)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from psarch.compare import label  # noqa: E402

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


def loss_curves(runs: list[dict], out: Path) -> str:
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        rows = run["metrics"]
        steps = [r["step"] for r in rows]
        clock, t = [], 0.0
        for r in rows:
            t += r["step_time_s"]
            clock.append(t)
        losses = [r["loss"] for r in rows]
        a.plot(steps, losses, label=label(run))
        b.plot(clock, losses, label=label(run))
    floor = runs[0]["summary"].get("entropy_floor")
    for ax, xlabel in ((a, "step"), (b, "wall-clock time of steps (s)")):
        if floor is not None:
            ax.axhline(floor, color="k", ls=":", lw=1, label="entropy floor")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
    a.legend(fontsize=7)
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
        tr = s["traffic"]["per_rank"]
        sent = sum(t["sent_per_step"] for t in tr) / len(tr)
        ax.bar(i - 0.3, sent / 2**20, 0.2, color="tab:blue", label="worker sent/step" if i == 0 else None)
        ax.bar(i - 0.1, s["predicted"]["traffic_per_step"]["worker_sent"] / 2**20, 0.2, color="tab:blue",
               alpha=0.45, hatch="//", label="worker (formula)" if i == 0 else None)
        servers = s.get("traffic", {}).get("servers") or []
        if servers:
            recv = sum(x["received"] for x in servers) / len(servers) / max(1, s["steps"])
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
    hists = [(label(r), r["summary"]["staleness"]) for r in runs if r["summary"].get("staleness")]
    if not hists:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(hists)
    for i, (name, h) in enumerate(hists):
        hist = h.get("histogram", h)
        xs = sorted(int(k) for k in hist)
        ax.bar([x + i * width for x in xs], [hist[str(x)] if str(x) in hist else hist[x] for x in xs], width,
               label=name)
    ax.set_xlabel("staleness (server version at apply - version the gradient was computed on)")
    ax.set_ylabel("updates")
    ax.legend(fontsize=7)
    return _save(fig, out, "staleness")


def all_plots(runs: list[dict[str, Any]], out: Path) -> list[str]:
    names = [loss_curves(runs, out), memory(runs, out), traffic(runs, out), throughput(runs, out)]
    s = staleness(runs, out)
    return names + ([s] if s else [])
