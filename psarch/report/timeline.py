"""`psarch report timeline RUN`: a run's measured step (its trace.json, written for train.trace_steps) beside
the step the simulator predicts for it (the backend's program played on the run's links with the run's compute,
as cluster.step_time predicts it, but one step from idle links), written as trace_predicted.json and drawn in
one picture, timeline.png: a row per lane of each node, a bar per span, both on one time axis."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from psarch.report.trace import read_trace, write_trace
from psarch.timeline import Span

# a lane's colour by what it holds; a lane that names a peer ("to rank 1", "to server 0", "ring") carries bytes
COLOURS = {"compute": "tab:blue", "waits": "tab:red", "step": "0.85"}
TRANSFER = "tab:orange"


def one_step(spans: list[Span], step: int | None = None) -> list[Span]:
    """The spans of one traced step (`step`; None: the last traced), from its earliest rank's start: every span
    that overlaps the window of the ranks' "step" spans of that step."""
    marks = [s for s in spans if s.lane == "step"]
    names = sorted({s.name for s in marks}, key=lambda n: int(n.split()[-1]))
    if not names:
        raise ValueError("the trace has no \"step\" lane: not a run's trace.json")
    want = names[-1] if step is None else f"step {step}"
    if want not in names:
        raise ValueError(f"step {step} was not traced; the trace holds {', '.join(names)}")
    lo = min(s.start for s in marks if s.name == want)
    hi = max(s.end for s in marks if s.name == want)
    return [Span(s.node, s.lane, s.name, s.start - lo, s.end - lo) for s in spans if s.start < hi and s.end > lo]


def draw(ax, spans: list[Span], title: str) -> None:   # noqa: ANN001 (a matplotlib Axes)
    """Spans as bars, a row per (node, lane) in order of first appearance, the first at the top."""
    rows: dict[tuple[str, str], int] = {}
    order = {"step": 0, "compute": 1, "waits": 3}   # then the lanes that carry bytes
    for s in sorted(spans, key=lambda s: (_node_order(s.node), order.get(s.lane, 2), s.lane)):
        rows.setdefault((s.node, s.lane), len(rows))
    wide = 0.004 * max((s.end for s in spans), default=0.0)   # bars wider than this show their edges
    for s in spans:
        y = rows[s.node, s.lane]
        ax.broken_barh([(s.start * 1e3, max((s.end - s.start) * 1e3, 1e-3))], (y - 0.4, 0.8),
                       facecolors=COLOURS.get(s.lane, TRANSFER), linewidth=0.6,
                       edgecolors="white" if s.end - s.start > wide else "none")
    ax.set_yticks(list(rows.values()), [f"{node}: {lane}" for node, lane in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _node_order(node: str) -> tuple[int, int, str]:
    kind, _, rest = node.partition(" ")
    number = rest.split()[0] if rest else ""
    return (kind != "rank", int(number) if number.isdigit() else 0, node)


def picture(measured: list[Span], predicted: list[Span], path: Path, title: str) -> Path:
    """Measured above predicted on one time axis (ms), saved as a PNG at `path`."""
    from psarch.report.style import plt

    rows = len({(s.node, s.lane) for s in measured}) + len({(s.node, s.lane) for s in predicted})
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 1.2 + 0.22 * rows),
                                      height_ratios=[max(1, len({(s.node, s.lane) for s in measured})),
                                                     max(1, len({(s.node, s.lane) for s in predicted}))])
    draw(top, measured, f"{title}: measured (trace.json)")
    draw(bottom, predicted, "predicted by the step simulator (trace_predicted.json)")
    bottom.set_xlabel("ms from the step's start (the cluster's time)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def predicted_spans(run_dir: Path) -> tuple[list[Span], str]:
    """The simulator's step of the run in `run_dir` (psarch.theory.simulated_spans with theory.step_inputs) and
    a title naming the run."""
    from psarch import theory
    from psarch.report.runs import label, load_run, run_config

    run = load_run(run_dir)
    cfg, summary = run_config(run), run["summary"]
    compute, backward, alpha = theory.step_inputs(summary)
    got = theory.simulated_spans(cfg, summary["params"], compute, backward, alpha)
    if got is None:
        raise ValueError(f"backend.kind = \"{cfg.backend.kind}\" writes no step program: nothing to predict")
    links = f"{cfg.cluster.link_mbps:g} Mbit/s links" + ("" if cfg.cluster.emulate else " (not emulated: loopback)")
    return got, f"{label(run)}, N = {cfg.backend.world_size}, {links}"


def main(argv: list[str] | None = None) -> int:
    """`psarch report timeline RUN [--step S]`: write RUN/trace_predicted.json and RUN/timeline.png."""
    ap = argparse.ArgumentParser(prog="psarch report timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run folder with trace.json (train.trace_steps)")
    ap.add_argument("--step", type=int, help="which traced step to draw (default: the last traced)")
    a = ap.parse_args(argv)
    try:
        measured = one_step(read_trace(a.run / "trace.json"), a.step)
        predicted, title = predicted_spans(a.run)
    except (OSError, ValueError) as e:   # ConfigError is a ValueError
        sys.exit(f"psarch report timeline: {a.run}: {e}")
    write_trace(a.run / "trace_predicted.json", predicted)
    png = picture(measured, predicted, a.run / "timeline.png", title)
    end = max(s.end for s in predicted)
    print(f"predicted step {end * 1e3:.1f} ms; measured step (its ranks' window) "
          f"{max(s.end for s in measured if s.lane == 'step') * 1e3:.1f} ms\n"
          f"written {a.run / 'trace_predicted.json'} and {png} (open the .json files in https://ui.perfetto.dev)")
    return 0
