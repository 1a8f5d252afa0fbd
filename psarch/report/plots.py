"""The comparison plots of `psarch compare` (PNG files): bars of memory, traffic and throughput per run,
measured beside theory, one colour per configuration; the curves live in psarch/report/curves.py. Each plot is built
by a `*_figure` function (what tests inspect) and saved by its namesake."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from psarch.records import Summary
from psarch.report import curves, nodes
from psarch.report.style import Palette, legend_below, save
from psarch.report.runs import Run, predicted_rank0_memory, predicted_worker_sent, worker_sent_per_step
from psarch.throughput import LOCKSTEP, OWN_PACE
from psarch.units import fmt_bytes

CATEGORIES = (("params", ""), ("grads", "//"), ("optimizer", ".."), ("buffers", "xx"))
MIB = 2**20
LOG_SPAN = 30.0   # bars whose largest and smallest non-zero values differ more than this go on a log axis
ROOM = 0.3        # the axis runs past the longest bar or tick by this fraction of its span, for value labels


def _bars(runs: list[Run], n_panels: int, width: float = 4.0) -> tuple[Any, Any]:
    """Horizontal bars, one row per run (top to bottom in the runs' order), panels side by side."""
    fig, axes = plt.subplots(1, n_panels, figsize=(2.2 + width * n_panels, 1.3 + 0.38 * len(runs)),
                             sharey=True, squeeze=False, layout="constrained")
    return fig, axes[0]


def _formula(ax: Any, y: int, value: float | None, first: bool) -> None:
    """Theory's figure: a black tick across the run's bar."""
    if value is not None:
        ax.plot([value, value], [y - 0.4, y + 0.4], color="k", lw=2, label="theory" if first else None)


def _run_ticks(ax: Any, runs: list[Run], palette: Palette) -> None:
    ax.set_yticks(range(len(runs)), [palette.name(r) for r in runs], fontsize=8)
    ax.invert_yaxis()


def frame(ax: Any, ends: list[float], unit: str) -> str:
    """Fit the x axis to bars ending at `ends` (and theory's ticks among them), with room past the longest
    for its value label so that nothing is clipped by the frame; a log axis where the non-zero ends span more
    than LOG_SPAN. Returns the axis label: `unit`, and 'log scale' where it is one."""
    positive = [e for e in ends if e > 0]
    top = max(positive, default=1.0)
    if positive and top / min(positive) > LOG_SPAN:
        ax.set_xscale("log")
        low = min(positive) / 2
        ax.set_xlim(low, top * (top / low) ** ROOM)
        return f"{unit}, log scale"
    ax.set_xlim(0, top * (1 + ROOM))
    return unit


def value_label(ax: Any, y: int, value: float, text: str, tick: float | None = None) -> None:
    """The bar's value written past the end of the bar and of theory's tick, whichever lies further right, so
    that it never sits on either."""
    x = max(v for v in (value, tick or 0.0) if v is not None)
    if ax.get_xscale() == "log" and x <= 0:
        x = ax.get_xlim()[0]
    ax.annotate(text, (x, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)


def _serving(runs: list[Run], figure: str) -> list[str]:
    """The roles whose nodes serve the ranks (a PS's servers) and measured `figure` in some run, in the runs'
    order: a panel each."""
    return list(dict.fromkeys(r.name for run in runs for r in nodes.serving(run["summary"])
                              if r.mean(figure)[0] is not None))


def _role_mean(run: Run, role: str, figure: str) -> tuple[float | None, float]:
    """(measured, predicted) of one node of `role` in this run (nodes.Role.mean); (None, 0) where it has none."""
    found = nodes.roles(run["summary"]).get(role)
    measured, predicted = found.mean(figure) if found else (None, None)
    return measured, predicted or 0.0


def memory_figure(runs: list[Run], palette: Palette) -> Any:
    """Model states per worker (rank 0) by category, per node of each serving role (a PS's servers), and the whole
    system (every node of every role): a PS worker holds no optimizer state, but its servers do."""
    serving = _serving(runs, "memory")
    fig, axes = _bars(runs, 2 + len(serving))
    worker_ax, system_ax = axes[0], axes[-1]
    ends: dict[int, list[float]] = {id(ax): [] for ax in axes}
    for y, run in enumerate(runs):
        s, colour = run["summary"], palette.colour(run)
        m = s["memory"]["per_rank"][0]
        left = 0.0
        for cat, hatch in CATEGORIES:
            worker_ax.barh(y, m.get(cat, 0) / MIB, left=left, color=colour, hatch=hatch, edgecolor="white")
            left += m.get(cat, 0) / MIB
        _formula(worker_ax, y, predicted_rank0_memory(s) / MIB, y == 0)
        ends[id(worker_ax)] += [left, predicted_rank0_memory(s) / MIB]
        for ax, role in zip(axes[1:], serving):
            held, predicted = _role_mean(run, role, "memory")
            if held is not None:
                ax.barh(y, held / MIB, color=colour)
                _formula(ax, y, predicted / MIB, False)
                ends[id(ax)] += [held / MIB, predicted / MIB]
        roles = nodes.roles(s).values()
        ranks_total = sum(r.total("memory")[0] for r in roles if not r.serves) / MIB
        measured, predicted = nodes.system(s)
        system_ax.barh(y, ranks_total, color=colour)
        if any(r.serves and r.measured for r in roles):
            system_ax.barh(y, measured / MIB - ranks_total, left=ranks_total, color=colour, alpha=0.45,
                           hatch="oo", edgecolor="white")
        _formula(system_ax, y, predicted / MIB, False)
        ends[id(system_ax)] += [measured / MIB, predicted / MIB]
    worker_ax.set_title("one worker (rank 0), by category", fontsize=9)
    for ax, role in zip(axes[1:], serving):
        ax.set_title(f"one {role} (mean over its nodes)", fontsize=9)
    system_ax.set_title("whole system: every node of every role", fontsize=9)
    for ax in axes:
        ax.set_xlim(0, max(ends[id(ax)], default=1.0) * 1.08 or 1.0)   # no bar runs into the frame
        ax.set_xlabel("model states (MiB)", fontsize=8)
    _run_ticks(worker_ax, runs, palette)
    shown = [cat for cat, _ in CATEGORIES if any(r["summary"]["memory"]["per_rank"][0].get(cat) for r in runs)]
    legend_below(fig, [worker_ax], {cat: Patch(facecolor="0.55", hatch=h, edgecolor="white")
                                    for cat, h in CATEGORIES + ((" + ".join(serving), "oo"),)
                                    if cat in shown or cat == " + ".join(serving) and serving})
    return fig


def traffic_figure(runs: list[Run], palette: Palette) -> Any:
    """Bytes one worker sends per step and one node of each serving role (a PS's servers) receives per step,
    beside theory's, each bar's value written beside it; a log axis where the bars span orders of magnitude."""
    serving = _serving(runs, "received")
    fig, axes = _bars(runs, 1 + len(serving))
    # (measured, predicted) per run; a run without the role has no measured bytes
    panels: list[list[tuple[float | None, float]]] = [
        [(worker_sent_per_step(r["summary"]), predicted_worker_sent(r["summary"])) for r in runs]]
    panels += [[_role_mean(r, role, "received") for r in runs] for role in serving]
    for i, (ax, bars) in enumerate(zip(axes, panels)):
        unit = frame(ax, [b / MIB for pair in bars for b in pair if b is not None], "MiB per step")
        for y, (run, (value, predicted)) in enumerate(zip(runs, bars)):
            if value is None:
                continue
            modelled = i == 0 and run["summary"]["traffic"]["per_rank"][0].get("modelled")
            ax.barh(y, value / MIB, color=palette.colour(run), hatch="//" if modelled else "", edgecolor="white",
                    label="modelled, not measured (native collectives)" if modelled else None)
            _formula(ax, y, predicted / MIB, y == 0)
            value_label(ax, y, value / MIB, fmt_bytes(value), predicted / MIB)
        ax.set_xlabel(unit, fontsize=8)
    axes[0].set_title("one worker: sent per step (mean over workers)", fontsize=9)
    for ax, role in zip(axes[1:], serving):
        ax.set_title(f"one {role}: received per step\n(run total incl. set-up / steps)", fontsize=9)
    _run_ticks(axes[0], runs, palette)
    legend_below(fig, list(axes))
    return fig


def predicted_step_time(summary: Summary) -> float | None:
    """Theory's step time for a run, where it gives one: only on an emulated cluster (summary's
    cluster.step_time, from theory.cluster_step); on loopback the links cost nothing theory could count."""
    return ((summary.get("cluster") or {}).get("step_time") or {}).get("predicted_s")


def throughput_figure(runs: list[Run], palette: Palette) -> Any:
    """Samples per second of each run, longest bar fastest, its value beside it; theory's figure where it gives
    one. Runs whose workers go at their own pace are hatched: their samples/s sums the workers' own rates."""
    fig, axes = _bars(runs, 1, width=6.0)
    ax = axes[0]
    theory = [(s["global_batch"] / step if (step := predicted_step_time(s)) else None)
              for s in (r["summary"] for r in runs)]
    unit = frame(ax, [r["summary"]["samples_per_s"] for r in runs] + [t for t in theory if t], "samples/s")
    for y, (run, predicted) in enumerate(zip(runs, theory)):
        s = run["summary"]
        own = not s["lockstep"]
        ax.barh(y, s["samples_per_s"], color=palette.colour(run), hatch="//" if own else "", edgecolor="white")
        _formula(ax, y, predicted, True)
        value_label(ax, y, s["samples_per_s"], f"{s['samples_per_s']:.0f}", predicted)
    ax.set_xlabel(unit, fontsize=8)
    fig.suptitle("throughput" + ("" if any(theory) else
                                 "\n(theory gives no step time for runs on one machine's loopback)"), fontsize=9)
    _run_ticks(ax, runs, palette)
    kinds = {False: f"workers in lockstep: {LOCKSTEP}", True: f"hatched, workers at their own pace: {OWN_PACE}"}
    legend_below(fig, [ax], {kinds[own]: Patch(facecolor="0.55", hatch="//" if own else "", edgecolor="white")
                             for own in sorted({not r["summary"]["lockstep"] for r in runs})})
    return fig


def memory(runs: list[Run], out: Path, palette: Palette) -> str:
    """memory.png; returns its name."""
    return save(memory_figure(runs, palette), out, "memory")


def traffic(runs: list[Run], out: Path, palette: Palette) -> str:
    """traffic.png; returns its name."""
    return save(traffic_figure(runs, palette), out, "traffic")


def throughput(runs: list[Run], out: Path, palette: Palette) -> str:
    """throughput.png; returns its name."""
    return save(throughput_figure(runs, palette), out, "throughput")


def all_plots(runs: list[Run], out: Path) -> list[str]:
    """Every plot of a report, in the same colours; returns their names (PNG files in `out`)."""
    palette = Palette(runs)
    names = [curves.loss_curves(runs, out, palette), curves.loss_curves(runs, out, palette, axis="time"),
             memory(runs, out, palette), traffic(runs, out, palette), throughput(runs, out, palette)]
    s = curves.staleness(runs, out, palette)
    return names + ([s] if s else [])
