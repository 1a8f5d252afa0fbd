"""Loss curves as small multiples (one panel per workload and mode) and staleness distributions, in the report's
colours. Nothing here assumes a loss's scale or an entropy floor: a user's factory may bring neither."""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from psarch.report.style import Palette, legend_beside, save
from psarch.report.runs import Run, step_clock, trailing_mean, workload_of
from psarch.report.seeds import interval, seed_groups
from psarch.throughput import WorkerRow

SYNC = "synchronous"
DIVERGE_FACTOR = 2.0   # a curve that ends above this times its start (in distance from zero) diverged
DIVERGED_RULE = f"diverged: a loss not finite, or the curve ends above {DIVERGE_FACTOR:g}x its start"
# keys that change neither the data nor the optimisation: runs alike but for these train the same model
NOT_TRAINING = ("name", "label", "out", "backend", "cluster", "convergence_target")


def panel_of(run: Run) -> str:
    """Every synchronous backend trains the same model on the same data: one panel; each PS mode its own."""
    s = run["summary"]
    return SYNC if s["lockstep"] else s["label"]


def diverged(curve: list[float]) -> bool:
    """A curve diverged where a loss in it is not finite, or it ends above DIVERGE_FACTOR x where it starts
    (measured from zero, so that the rule holds for a loss of any sign or scale, with or without a floor)."""
    if not all(math.isfinite(v) for v in curve):
        return True
    return bool(curve) and curve[-1] > curve[0] + (DIVERGE_FACTOR - 1) * abs(curve[0])


def _worker_rows(run: Run) -> dict[int, list[WorkerRow]]:
    by_rank: dict[int, list[WorkerRow]] = {}
    for row in run["metrics"]:
        workers = row.get("workers")
        if workers:
            for w in workers:
                by_rank.setdefault(w["rank"], []).append(w)
        else:   # one worker ran the step: the row is its own, rank 0's
            by_rank.setdefault(0, []).append(row)
    return by_rank


def per_update(run: Run, axis: str) -> tuple[list[float], list[float]] | None:
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
            if axis == "step":
                x = version / n
            else:
                assert t0 is not None   # returned above where it is None
                x = w["extra"]["t_end"] - t0
            points.append((x, w["loss"]))
    points.sort()
    return [p[0] for p in points], [p[1] for p in points]


def curve(run: Run, axis: str, window: int) -> tuple[list[float], list[float], bool]:
    """(x, `window`-step mean loss, whether x counts model versions): workers at their own pace by the model
    version each loss was computed on where their rows record it, every other run by step or summed step time."""
    if not run["summary"]["lockstep"]:
        pts = per_update(run, axis)
        if pts is not None:
            return pts[0], trailing_mean(pts[1], window * run["summary"]["world_size"]), True
    rows = run["metrics"]
    xs: list[float] = [r["step"] + 1 for r in rows] if axis == "step" else step_clock(rows)
    return xs, trailing_mean([r["loss"] for r in rows], window), False


def _training(run: Run) -> dict[str, Any]:
    return {k: v for k, v in run["config"].items() if k not in NOT_TRAINING}


def coincide_note(runs: list[Run]) -> str:
    """How far synchronous curves lie apart where they coincide by design (same data, global batch and training
    config: only the backend differs); empty where they need not."""
    if len(runs) < 2 or any(_training(r) != _training(runs[0]) for r in runs[1:]):
        return ""
    losses = [[r["loss"] for r in run["metrics"]] for run in runs]
    steps = min(map(len, losses))
    gap = max((abs(a[i] - losses[0][i]) for a in losses[1:] for i in range(steps)
               if math.isfinite(a[i]) and math.isfinite(losses[0][i])), default=0.0)
    return f"{len(runs)} curves coincide by design (same data, batch, training): largest difference {gap:.1e}"


def panels(runs: list[Run]) -> dict[tuple[str, str], list[Run]]:
    """The runs of each (workload, panel) in the runs' order: runs of different workloads never share a panel."""
    out: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        out.setdefault((workload_of(run), panel_of(run)), []).append(run)
    return out


def y_range(curves: list[list[float]], floor: float | None) -> tuple[float, float]:
    """The loss axis of one workload: the whole of every curve given (those that did not diverge) and its floor,
    with a little room above and below."""
    finite = [x for v in curves for x in v if math.isfinite(x)] + ([floor] if floor is not None else [])
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 1.0
    return lo - pad, hi + pad


def _draw_panel(ax: Any, members: list[Run], reference: Run | None, axis: str, window: int,
                palette: Palette) -> tuple[list[tuple[list[float], bool]], bool]:
    """One panel's curves (the synchronous reference in grey first); returns each curve with whether it
    diverged, and whether x counts model versions."""
    drawn, by_version = [], bool(members)
    if reference is not None:
        xs, ys, _ = curve(reference, axis, window)
        ax.plot(xs, ys, color="0.6", lw=1, label=f"{palette.name(reference)} (sync reference)")
        drawn.append((ys, diverged(ys)))
    for group in seed_groups(members):
        curves = [curve(run, axis, window) for run in group]
        by_version &= all(versions for _, _, versions in curves)
        if len(group) == 1:
            xs, ys, _ = curves[0]
            drawn.append((ys, diverged(ys)))
            ax.plot(xs, ys, label=palette.name(group[0]) + (" (diverged)" if drawn[-1][1] else ""),
                    **palette.line(group[0]))
            continue
        xs, mean, half = seed_band(curves)
        gone = sum(diverged(ys) for _, ys, _ in curves)
        drawn.append((mean, diverged(mean)))
        style = palette.line(group[0])
        ax.plot(xs, mean, label=f"{palette.name(group[0])}: mean of {len(group)} seeds"
                + (f" ({gone} diverged)" if gone else ""), **style)
        ax.fill_between(xs, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                        color=style.get("color"), alpha=0.2, lw=0)
    return drawn, by_version


def seed_band(curves: list[tuple[list[float], list[float], bool]]) -> tuple[list[float], list[float], list[float]]:
    """A seed group's curves as one: at each point the runs share (the shortest run's length), the mean x, the
    mean loss and the half-width of its 95% confidence interval (psarch/report/seeds.py); non-finite losses left out."""
    length = min(len(ys) for _, ys, _ in curves)
    xs, mean, half = [], [], []
    for i in range(length):
        ci = interval([ys[i] for _, ys, _ in curves])
        if ci is None:
            break
        xs.append(statistics.fmean(x[i] for x, _, _ in curves))
        mean.append(ci.mean)
        half.append(ci.half if math.isfinite(ci.half) else 0.0)
    return xs, mean, half


def _title(workload: str, panel: str, members: list[Run], several: bool, axis: str) -> str:
    note = coincide_note(members) if panel == SYNC and axis == "step" else ""   # in time each runs at its speed
    head = f"{workload}: {panel}" if several else panel
    return head + ("\n" + note.replace(": ", ":\n", 1) if note else "")


def loss_figure(runs: list[Run], palette: Palette, axis: str = "step") -> Any:
    """One panel per workload and mode, against steps (runs at their own pace: server updates / N) or
    wall-clock time of steps; each workload's first synchronous run drawn in grey in its other panels as the
    reference; one loss axis per workload; the legend beside the panels."""
    groups = panels(runs)
    cols = min(3, len(groups))
    rows_n = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.8 * cols + 3.0, 3.3 * rows_n + 0.6), squeeze=False,
                             layout="constrained")
    window = max(1, max((len(r["metrics"]) for r in runs), default=1) // 40)
    several = len({w for w, _ in groups}) > 1
    drawn: dict[str, list[tuple[list[float], bool]]] = {}
    floors = {workload_of(r): r["summary"].get("entropy_floor") for r in reversed(runs)}
    for ax, ((workload, panel), members) in zip(axes.flat, groups.items()):
        reference = None if panel == SYNC else groups.get((workload, SYNC), [None])[0]
        curves, by_version = _draw_panel(ax, members, reference, axis, window, palette)
        drawn.setdefault(workload, []).extend(curves)
        if floors[workload] is not None:
            ax.axhline(floors[workload], color="k", ls=":", lw=1, label="entropy floor")
        ax.set_title(_title(workload, panel, members, several, axis), fontsize=8)
        ax.set_xlabel("wall-clock time of steps (s)" if axis == "time" else
                      "server updates / N (by model version)" if by_version else "step", fontsize=8)
        ax.set_ylabel(f"loss ({window}-step mean)" if window > 1 else "loss", fontsize=8)
    for ax, (workload, _) in zip(axes.flat, groups):   # curves that diverged run off the axis, unless all did
        kept = [ys for ys, bad in drawn[workload] if not bad] or [ys for ys, _ in drawn[workload]]
        ax.set_ylim(*y_range(kept, floors[workload]))
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    legend_beside(fig, list(axes.flat)[:len(groups)])
    any_diverged = any("(diverged)" in line.get_label() for ax in axes.flat for line in ax.get_lines())
    has_floor = any(f is not None for f in floors.values())
    fig.suptitle("Loss by mode" + ("; dotted: the data's entropy floor" if has_floor else "")
                 + (f"\n({DIVERGED_RULE})" if any_diverged else ""), fontsize=10)
    return fig


def loss_curves(runs: list[Run], out: Path, palette: Palette, axis: str = "step") -> str:
    """loss.png (against steps) or loss_time.png (against time): loss_figure, saved; returns the name."""
    return save(loss_figure(runs, palette, axis), out, "loss" if axis == "step" else "loss_time")


def staleness_figure(runs: list[Run], palette: Palette) -> Any | None:
    """Each async run's staleness distribution as bars over integer staleness (fraction of its updates, so
    that runs with different numbers of updates compare), runs side by side at each value; the x range ends at
    the last value that holds 1% of some run's updates, and the axis label says what share lies beyond it
    (tail_words; the legend gives each maximum). None without staleness."""
    hists = [(r, r["summary"]["staleness"]) for r in runs if r["summary"].get("staleness")]
    if not hists:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    fracs = []
    for _, h in hists:
        hist = {int(k): v for k, v in h.get("histogram", h).items()}
        fracs.append({k: v / (sum(hist.values()) or 1) for k, v in hist.items()})
    right = max([1] + [k for f in fracs for k, v in f.items() if v >= 1e-2])
    width = 0.8 / len(hists)
    for i, ((run, h), f) in enumerate(zip(hists, fracs)):
        xs = list(range(right + 1))
        ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], [f.get(x, 0.0) for x in xs], width,
               color=palette.colour(run), hatch=palette.hatch(run), edgecolor="white",
               label=f"{palette.name(run)} (mean {h.get('mean', 0):.2f}, max {max(f)})")
    ax.set_xlim(-0.5, right + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("staleness (server version at apply - version the gradient was computed on); "
                  + tail_words(fracs, right), fontsize=8)
    ax.set_ylabel("fraction of updates")
    legend_beside(fig, [ax])
    return fig


def tail_words(fracs: list[dict[int, float]], right: int) -> str:
    """What the staleness axis leaves out beyond `right`, from each run's fractions of updates by staleness: the
    largest share of one run's updates that lies beyond it (the values each hold little; together they may not)."""
    tail = max(sum(v for k, v in f.items() if k > right) for f in fracs)
    if tail == 0:
        return "every update shown"
    return f"beyond {right}: at most {tail:.2%} of a run's updates"


def staleness(runs: list[Run], out: Path, palette: Palette) -> str | None:
    """staleness.png: staleness_figure, saved; returns the name, or None without async runs."""
    fig = staleness_figure(runs, palette)
    return save(fig, out, "staleness") if fig is not None else None
