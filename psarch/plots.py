"""The comparison plots of `psarch compare` (PNG files): bars of memory, traffic and throughput per run,
measured beside theory, one colour per configuration; the curves live in psarch/curves.py."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from psarch import curves
from psarch.plot_style import Palette, save
from psarch.runs import (predicted_rank0_memory, predicted_system_memory, predicted_worker_sent, server_memory,
                         server_received_per_step, system_memory, worker_sent_per_step)

CATEGORIES = (("params", ""), ("grads", "//"), ("optimizer", ".."), ("buffers", "xx"))
MIB = 2**20


def _bars(runs: list[dict[str, Any]], n_panels: int, width: float = 4.0) -> tuple[Any, Any]:
    """Horizontal bars, one row per run (top to bottom in the runs' order), panels side by side."""
    fig, axes = plt.subplots(1, n_panels, figsize=(2.2 + width * n_panels, 0.9 + 0.38 * len(runs)),
                             sharey=True, squeeze=False)
    return fig, axes[0]


def _formula(ax: Any, y: int, value: float | None, first: bool) -> None:
    """Theory's figure: a black tick across the run's bar."""
    if value is not None:
        ax.plot([value, value], [y - 0.4, y + 0.4], color="k", lw=2, label="theory" if first else None)


def _run_ticks(ax: Any, runs: list[dict[str, Any]], palette: Palette) -> None:
    ax.set_yticks(range(len(runs)), [palette.name(r) for r in runs], fontsize=8)
    ax.invert_yaxis()


def memory(runs: list[dict[str, Any]], out: Path, palette: Palette) -> str:
    """Model states per worker (rank 0) by category, per PS server, and the whole system (every worker and
    server): a PS worker holds no optimizer state, but its servers do."""
    has_servers = any(server_memory(r["summary"]) for r in runs)
    fig, axes = _bars(runs, 3 if has_servers else 2)
    worker_ax, system_ax = axes[0], axes[-1]
    for y, run in enumerate(runs):
        s, colour = run["summary"], palette.colour(run)
        m, p = s["memory"]["per_rank"][0], s["predicted"]
        left = 0.0
        for cat, hatch in CATEGORIES:
            worker_ax.barh(y, m.get(cat, 0) / MIB, left=left, color=colour, hatch=hatch, edgecolor="white",
                           label=cat if y == 0 or cat == "buffers" else None)
            left += m.get(cat, 0) / MIB
        _formula(worker_ax, y, predicted_rank0_memory(s) / MIB, y == 0)
        servers = server_memory(s)
        if has_servers and servers:
            axes[1].barh(y, sum(servers) / len(servers) / MIB, color=colour)
            _formula(axes[1], y, (p.get("server_memory") or 0) / MIB, False)
        workers_total = sum(x["total"] for x in s["memory"]["per_rank"]) / MIB
        system_ax.barh(y, workers_total, color=colour)
        system_ax.barh(y, system_memory(s) / MIB - workers_total, left=workers_total, color=colour, alpha=0.45,
                       hatch="oo", edgecolor="white", label="servers" if servers else None)
        _formula(system_ax, y, predicted_system_memory(s) / MIB, False)
    worker_ax.set_title("one worker (rank 0), by category", fontsize=9)
    if has_servers:
        axes[1].set_title("one PS server (mean over servers)", fontsize=9)
    system_ax.set_title("whole system: all workers + all servers", fontsize=9)
    for ax in axes:
        ax.set_xlabel("model states (MiB)", fontsize=8)
    _run_ticks(worker_ax, runs, palette)
    handles, labels = worker_ax.get_legend_handles_labels()
    h2, l2 = system_ax.get_legend_handles_labels()
    keep = dict(zip(labels + l2, handles + h2))
    fig.legend(keep.values(), keep.keys(), fontsize=8, loc="lower center", ncol=len(keep), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return save(fig, out, "memory")


def traffic(runs: list[dict[str, Any]], out: Path, palette: Palette) -> str:
    """Bytes one worker sends per step and one PS server receives per step, beside theory's."""
    has_servers = any(server_received_per_step(r["summary"]) is not None for r in runs)
    fig, axes = _bars(runs, 2 if has_servers else 1)
    for y, run in enumerate(runs):
        s, colour = run["summary"], palette.colour(run)
        modelled = s["traffic"]["per_rank"][0].get("modelled")
        axes[0].barh(y, worker_sent_per_step(s) / MIB, color=colour, hatch="//" if modelled else "",
                     edgecolor="white", label="modelled, not measured (native collectives)" if modelled else None)
        _formula(axes[0], y, predicted_worker_sent(s) / MIB, y == 0)
        recv = server_received_per_step(s)
        if recv is not None:
            axes[1].barh(y, recv / MIB, color=colour)
            _formula(axes[1], y, s["predicted"]["traffic_per_step"].get("server_received", 0) / MIB, False)
    axes[0].set_title("one worker: sent per step (mean over workers)", fontsize=9)
    axes[0].set_xlabel("MiB per step", fontsize=8)
    if has_servers:
        axes[1].set_title("one PS server: received per step\n(run total incl. set-up / steps)", fontsize=9)
        axes[1].set_xlabel("MiB per step", fontsize=8)
    _run_ticks(axes[0], runs, palette)
    handles, labels = axes[0].get_legend_handles_labels()
    keep = dict(zip(labels, handles))
    fig.legend(keep.values(), keep.keys(), fontsize=8, loc="lower center", ncol=len(keep), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return save(fig, out, "traffic")


def predicted_step_time(summary: dict[str, Any]) -> float | None:
    """Theory's step time for a run, where it gives one: only on an emulated cluster (summary's
    cluster.step_time, from theory.cluster_step); on loopback the links cost nothing theory could count."""
    return ((summary.get("cluster") or {}).get("step_time") or {}).get("predicted_s")


def throughput(runs: list[dict[str, Any]], out: Path, palette: Palette) -> str:
    """Samples per second of each run, longest bar fastest; theory's figure beside it where it gives one."""
    fig, axes = _bars(runs, 1, width=6.0)
    ax = axes[0]
    predicted_any = False
    for y, run in enumerate(runs):
        s = run["summary"]
        ax.barh(y, s["samples_per_s"], color=palette.colour(run))
        ax.text(s["samples_per_s"], y, f" {s['samples_per_s']:.0f}", va="center", fontsize=7)
        step = predicted_step_time(s)
        if step:
            predicted_any = True
            _formula(ax, y, s["global_batch"] / step, True)
    ax.set_xlabel("samples/s (global batch / median step time)", fontsize=8)
    ax.set_title("throughput" + ("" if predicted_any else
                                 " (theory gives no step time for runs on one machine's loopback)"), fontsize=9)
    _run_ticks(ax, runs, palette)
    if predicted_any:
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(dict(zip(labels, handles)).values(), dict(zip(labels, handles)).keys(), fontsize=7)
    return save(fig, out, "throughput")


def all_plots(runs: list[dict[str, Any]], out: Path) -> list[str]:
    """Every plot of a report, in the same colours; returns their names (PNG files in `out`)."""
    palette = Palette(runs)
    names = [curves.loss_curves(runs, out, palette), curves.loss_curves(runs, out, palette, axis="time"),
             memory(runs, out, palette), traffic(runs, out, palette), throughput(runs, out, palette)]
    s = curves.staleness(runs, out, palette)
    return names + ([s] if s else [])
