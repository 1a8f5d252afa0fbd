"""What a user reads after runs: `psarch compare` (compare.py, with its sections links.py, ranks.py, sparse.py and
seeds.py's confidence intervals over repeated seeds) and its plots (plots.py, curves.py, style.py), one run's own
plot (plot_run.py), a run folder read back (runs.py) with its nodes by role, measured | predicted (nodes.py), and the
studies' tables, each `psarch report NAME ...`: `crossover` (PS over ring DDP against BytePS's bound), `cluster`
(step time on an emulated cluster, measured | predicted), `stragglers` (samples/s and time to a target gap, each
worker at its own pace), `pipeline` (the model-parallel table) and `timeline` (a run's traced step beside the
simulator's, timeline.py; the Chrome trace format, trace.py). A study's table reads run folders of the backends it
compares, so this package may name backends' figures; the core under it does not. Nothing is imported here.
"""

NAMES = ("crossover", "cluster", "stragglers", "pipeline", "timeline")


def run(name: str, argv: list[str]) -> int:
    """Write and print study table `name` (one of NAMES), given its own command-line arguments `argv`."""
    import importlib

    if name not in NAMES:
        raise SystemExit(f"psarch report: unknown report {name!r}; choose one of {', '.join(NAMES)}")
    return importlib.import_module(f"psarch.report.{name}").main(argv) or 0
