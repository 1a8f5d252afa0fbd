"""Loss curves as small multiples (one panel per mode) and staleness distributions, in the report's colours."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from psarch.plot_style import Palette, save
from psarch.runs import step_clock, trailing_mean

SYNC = "synchronous"


def panel_of(run: dict[str, Any]) -> str:
    """Every synchronous backend trains the same model on the same data: one panel; each PS mode its own."""
    s = run["summary"]
    return SYNC if s["lockstep"] else s["label"]


def _worker_rows(run: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for row in run["metrics"]:
        for w in row.get("workers") or [dict(row, rank=0)]:
            by_rank.setdefault(w["rank"], []).append(w)
    return by_rank


def per_update(run: dict[str, Any], axis: str) -> tuple[list[float], list[float]] | None:
    """An async/ssp run's losses, every worker's, in the order of the model version they were computed on:
    x = server updates / N (comparable to a synchronous step), or seconds since the first step began.
    None when the rows carry no versions. Each worker's first loss is left out: its model's version is
    not recorded (a worker that starts late pulls a model others have already trained)."""
    n = run["summary"]["world_size"]
    points = []
    t0 = min((w["extra"]["t_start"] for ws in _worker_rows(run).values() for w in ws
              if "t_start" in w.get("extra", {})), default=None)
    for ws in _worker_rows(run).values():
        for before, w in zip(ws, ws[1:]):
            version = before.get("extra", {}).get("version")
            if version is None or (axis == "time" and t0 is None):
                return None
            x = version / n if axis == "step" else w["extra"]["t_end"] - t0
            points.append((x, w["loss"]))
    points.sort()
    return [p[0] for p in points], [p[1] for p in points]


def _curve(run: dict[str, Any], axis: str, window: int) -> tuple[list[float], list[float]]:
    if panel_of(run) in ("ps async", "ps ssp"):
        pts = per_update(run, axis)
        if pts is not None:
            return pts[0], trailing_mean(pts[1], window * run["summary"]["world_size"])
    rows = run["metrics"]
    xs = [r["step"] + 1 for r in rows] if axis == "step" else step_clock(rows)
    return xs, trailing_mean([r["loss"] for r in rows], window)


def _coincide_note(runs: list[dict[str, Any]]) -> str:
    """How far the synchronous curves lie apart: they coincide by design (same data, same global batch)."""
    losses = [[r["loss"] for r in run["metrics"]] for run in runs]
    steps = min(map(len, losses))
    gap = max((abs(a[i] - losses[0][i]) for a in losses[1:] for i in range(steps)
               if math.isfinite(a[i]) and math.isfinite(losses[0][i])), default=0.0)
    return f"{len(runs)} curves coincide by design\n(same data and global batch):\nlargest difference {gap:.1e}"


def loss_curves(runs: list[dict[str, Any]], out: Path, palette: Palette, axis: str = "step") -> str:
    """One panel per mode, against steps (async/ssp: server updates / N) or wall-clock time of steps;
    the synchronous runs' first curve is drawn in grey in every other panel as the reference."""
    panels: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        panels.setdefault(panel_of(run), []).append(run)
    cols = min(3, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.8 * cols, 3.3 * rows_n + 0.4), sharey=True, squeeze=False)
    steps_max = max((len(r["metrics"]) for r in runs), default=1)
    window = max(1, steps_max // 40)
    first = [x["loss"] for r in runs for x in r["metrics"][:window] if math.isfinite(x["loss"])]
    top = max(first, default=1.0)
    floor = runs[0]["summary"].get("entropy_floor")
    reference = panels.get(SYNC, [None])[0]
    for ax, (title, members) in zip(axes.flat, panels.items()):
        if reference is not None and title != SYNC:
            ax.plot(*_curve(reference, axis, window), color="0.6", lw=1, label=f"{palette.name(reference)} (sync reference)")
        for run in members:
            xs, ys = _curve(run, axis, window)
            diverged = any(not math.isfinite(v) or v > 1.1 * top for v in ys)
            ax.plot(xs, ys, label=palette.name(run) + (" (diverged)" if diverged else ""), **palette.line(run))
        if floor is not None:
            ax.axhline(floor, color="k", ls=":", lw=1)
        ax.set_title(title, fontsize=10)
        if title == SYNC and len(members) > 1 and axis == "step":   # in time they differ: each runs at its speed
            ax.text(0.97, 0.97, _coincide_note(members), transform=ax.transAxes, ha="right", va="top", fontsize=7)
        xlabel = "wall-clock time of steps (s)" if axis == "time" else "step"
        if title in ("ps async", "ps ssp") and axis == "step":
            xlabel = "server updates / N (each worker's own losses, by model version)"
        ax.set_xlabel(xlabel, fontsize=8)
        ax.legend(fontsize=6, loc="center right" if title == SYNC and len(members) > 1 else "upper right")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    bottom = floor if floor is not None else min((v for v in first), default=0.0)
    axes[0][0].set_ylim(bottom - 0.05 * (top - bottom), 1.1 * top - 0.1 * bottom)
    for row in axes:
        row[0].set_ylabel(f"loss ({window}-step mean)" if window > 1 else "loss")
    floor_note = "; dotted: the data's entropy floor" if floor is not None else ""
    fig.suptitle(f"Loss by mode{floor_note}", fontsize=10)
    return save(fig, out, "loss" if axis == "step" else "loss_time")


def staleness(runs: list[dict[str, Any]], out: Path, palette: Palette) -> str | None:
    """Each async run's staleness distribution as a line (fraction of its updates), so that runs with
    different numbers of updates compare; the x range ends where every run has < 1% of its updates
    (the legend gives each maximum)."""
    hists = [(r, r["summary"]["staleness"]) for r in runs if r["summary"].get("staleness")]
    if not hists:
        return None
    fig, ax = plt.subplots(figsize=(9, 5))
    right = 1
    for run, h in hists:
        hist = {int(k): v for k, v in h.get("histogram", h).items()}
        total = sum(hist.values()) or 1
        xs = list(range(max(hist) + 1))
        fracs = [hist.get(x, 0) / total for x in xs]
        right = max(right, max((x for x, f in zip(xs, fracs) if f >= 1e-2), default=1))
        ax.plot(xs, fracs, marker=".", ms=3, label=f"{palette.name(run)} (mean {h.get('mean', 0):.2f}, max {max(hist)})",
                **palette.line(run))
    ax.set_xlim(-0.5, right + 0.5)
    ax.set_xlabel("staleness (server version at apply - version the gradient was computed on)")
    ax.set_ylabel("fraction of updates")
    ax.legend(fontsize=6)
    return save(fig, out, "staleness")
