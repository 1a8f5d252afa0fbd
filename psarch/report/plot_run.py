"""One run's own plot, curves.png in its folder: the loss and the throughput per step, written when the run
finishes (`psarch compare` draws several runs against each other and against theory)."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from psarch.report.style import save
from psarch.report.runs import Run

NAME = "curves"


def run_figure(run: Run) -> Any:
    """Two panels over the steps: the loss (each step's, faint, and its train.log_every-step trailing mean, the
    progress lines' window) above the entropy floor where the workload has one; samples/s per step with the
    run's figure (the summary's) as a line."""
    import matplotlib.pyplot as plt

    from psarch.report.runs import trailing_mean

    s, rows = run["summary"], run["metrics"]
    window = max(1, (run["config"].get("train") or {}).get("log_every", 10))
    steps = [r["step"] + 1 for r in rows]
    losses = [r["loss"] for r in rows]
    fig, (loss_ax, rate_ax) = plt.subplots(2, 1, figsize=(9.5, 5.5), sharex=True, layout="constrained")
    loss_ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="loss (each step)")
    loss_ax.plot(steps, trailing_mean(losses, window), color="tab:blue", lw=1.6,
                 label=f"{window}-step mean (as the progress lines)")
    if s.get("entropy_floor") is not None:
        loss_ax.axhline(s["entropy_floor"], color="k", ls="--", lw=1, label=f"entropy floor {s['entropy_floor']:.3f}")
    loss_ax.set_ylabel("loss (mean over the ranks)")
    loss_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))   # beside, never on the data
    loss_ax.set_title(f"{s['name']}: {s.get('label') or s['backend']}, N = {s['world_size']}, final loss "
                      f"{s['final_loss']:.4f}", fontsize=10)
    rates = [s["global_batch"] / r["step_time_s"] for r in rows]
    rate_ax.plot(steps, rates, color="tab:orange", alpha=0.35, lw=0.8, label="global batch / step time")
    rate_ax.plot(steps, _trailing_median(rates, window), color="tab:orange", lw=1.6, label=f"{window}-step median")
    rate_ax.axhline(s["samples_per_s"], color="k", ls="--", lw=1,
                    label=f"run: {s['samples_per_s']:.1f} samples/s\n({s.get('samples_per_s_is', 'summary')})")
    rate_ax.set_ylim(0, 1.3 * max(max(_trailing_median(rates, window)), s["samples_per_s"]))
    rate_ax.set_ylabel("samples/s")
    rate_ax.set_xlabel("step")
    rate_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def _trailing_median(values: list[float], window: int) -> list[float]:
    """The median of each value and the window - 1 before it: a step time's outliers (the first steps, a
    checkpoint) do not pull it, as they do not the summary's median step time."""
    return [statistics.median(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def write(run_dir: str | Path) -> Path:
    """Draw a finished run's curves.png into its folder; its path."""
    from psarch.report.runs import load_run

    run_dir = Path(run_dir)
    run = load_run(run_dir)
    save(run_figure(run), run_dir, NAME)
    return run_dir / f"{NAME}.png"
