"""`psarch report timeline RUN`: a run's measured step (its trace.json, written for train.trace_steps) beside
the step the simulator predicts for it (the backend's program played on the run's links with the run's compute,
as cluster.step_time predicts it, but one step from idle links), written as trace_predicted.json and drawn in
one picture, timeline.png: a row per lane of each node, a bar per span, both on one time axis. Given a config
file and a compute time instead, the predicted step alone, before any run."""
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
    role, _, rest = node.partition(" ")
    number = rest.split()[0] if rest else ""
    return (role != "rank", int(number) if number.isdigit() else 0, node)


def picture(panels: list[tuple[list[Span], str]], path: Path) -> Path:
    """Timelines (spans, title) one above the other on one time axis (ms), saved as a PNG at `path`."""
    from psarch.report.style import plt

    rows = [max(1, len({(s.node, s.lane) for s in spans})) for spans, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(10, 1.2 + 0.22 * sum(rows)),
                             height_ratios=rows, squeeze=False)
    for ax, (spans, title) in zip(axes[:, 0], panels):
        draw(ax, spans, title)
    axes[-1, 0].set_xlabel("ms from the step's start (the cluster's time)")
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


def config_spans(path: Path, compute_s: float, alpha_s: float) -> tuple[list[Span], str]:
    """The simulator's step of the config at `path` before any run: its program on its cluster's links, each
    worker computing `compute_s` a step (backward 2/3 of it), α per message; Φ counted on the meta device."""
    from psarch import theory
    from psarch.config import load_config
    from psarch.workload import build_workload

    cfg = load_config(path)
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters() if p.requires_grad)
    got = theory.simulated_spans(cfg, phi, compute_s, None, alpha_s)
    if got is None:
        raise ValueError(f"backend.kind = \"{cfg.backend.kind}\" writes no step program: nothing to predict")
    return got, f"{cfg.name}, N = {cfg.backend.world_size}, {cfg.cluster.link_mbps:g} Mbit/s links"


def main(argv: list[str] | None = None) -> int:
    """`psarch report timeline RUN [--step S]`: write RUN/trace_predicted.json and RUN/timeline.png; or
    `psarch report timeline CONFIG.toml --compute-s S --out DIR`: the predicted step alone."""
    ap = argparse.ArgumentParser(prog="psarch report timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run folder with trace.json (train.trace_steps), or a config file")
    ap.add_argument("--step", type=int, help="which traced step to draw (default: the last traced)")
    ap.add_argument("--compute-s", type=float, help="a config: each worker's compute per step, seconds")
    ap.add_argument("--alpha", type=float, default=0.0, help="a config: seconds per message (default 0)")
    ap.add_argument("--out", type=Path, help="a config: the folder to write in (default: beside the config)")
    a = ap.parse_args(argv)
    if a.run.is_file():
        return _config(a)
    try:
        measured = one_step(read_trace(a.run / "trace.json"), a.step)
        predicted, title = predicted_spans(a.run)
    except (OSError, ValueError) as e:   # ConfigError is a ValueError
        sys.exit(f"psarch report timeline: {a.run}: {e}")
    write_trace(a.run / "trace_predicted.json", predicted)
    png = picture([(measured, f"{title}: measured (trace.json)"),
                   (predicted, "predicted by the step simulator (trace_predicted.json)")], a.run / "timeline.png")
    end = max(s.end for s in predicted)
    print(f"predicted step {end * 1e3:.1f} ms; measured step (its ranks' window) "
          f"{max(s.end for s in measured if s.lane == 'step') * 1e3:.1f} ms\n"
          f"written {a.run / 'trace_predicted.json'} and {png} (open the .json files in https://ui.perfetto.dev)")
    return 0


def _config(a: argparse.Namespace) -> int:
    if a.compute_s is None or a.compute_s < 0 or a.alpha < 0:
        sys.exit(f"psarch report timeline: {a.run} is a config: give --compute-s (>= 0; --alpha >= 0)")
    try:
        predicted, title = config_spans(a.run, a.compute_s, a.alpha)
    except (OSError, ValueError) as e:
        sys.exit(f"psarch report timeline: {a.run}: {e}")
    out = a.out or a.run.parent
    out.mkdir(parents=True, exist_ok=True)
    trace = write_trace(out / f"{a.run.stem}_predicted.json", predicted)
    png = picture([(predicted, f"{title}: predicted by the step simulator")], out / f"{a.run.stem}_predicted.png")
    print(f"predicted step {max(s.end for s in predicted) * 1e3:.1f} ms\nwritten {trace} and {png}")
    return 0
