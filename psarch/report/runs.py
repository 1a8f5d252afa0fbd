"""A finished run folder read back, and the figures derived from it that `compare`, the plots and
`estimate --from` all show (each computed here once)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from pathlib import Path
import sys
from typing import Any, Callable, TypedDict, TypeVar, cast

from psarch import throughput
from psarch.config import Config, from_record
from psarch.launch.outputs import identity
from psarch.report import nodes
from psarch.throughput import warmup_steps
from psarch.records import MetricsRow, Summary
from psarch.theory import predict


class Run(TypedDict):
    """A finished run folder read back (load_run): what every report reads of a run."""

    path: str
    summary: Summary             # summary.json, its prediction and names as this checkout makes them
    config: dict[str, Any]       # config.json as written ({} where the folder has none)
    metrics: list[MetricsRow]    # metrics.jsonl
    run_label: str               # its name in tables and plots (name_runs)


def load_run(path: str | Path) -> Run:
    """A finished run folder's summary, config (as written) and per-step metrics; the summary's `predicted` is
    theory.predict's for the run's config. A failed or interrupted run raises ValueError (one line)."""
    path = Path(path)
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        raise FileNotFoundError(f"{path}: not a run folder (no summary.json)")
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()] \
        if (path / "metrics.jsonl").is_file() else []
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    summary: Summary = json.loads(summary_path.read_text())
    if summary.get("status", "finished") != "finished":   # a stopped run's summary has no figures
        raise ValueError(f"{path}: the run {summary['status']} ({summary.get('error') or 'no error recorded'}); "
                         f"no figures to load")
    # its name in reports: the config's label, else its folder's (name_runs tells apart runs that share one)
    run: Run = {"path": str(path), "summary": summary, "config": config, "metrics": rows,
                "run_label": config.get("label") or path.resolve().name}
    if config:  # theory, names and samples/s as they stand now, not as they stood when the run was made
        cfg = run_config(run)
        summary["predicted"] = predict(cfg, summary["params"], summary.get("frozen_params", 0)).to_dict()
        ident = identity(cfg)
        summary["variant"], summary["label"], summary["lockstep"] = ident["variant"], ident["label"], ident["lockstep"]
        if rows:
            summary["samples_per_s"] = throughput.samples_per_s(rows, cfg.train.global_batch, summary["lockstep"],
                                                                warmup_steps(cfg))
            summary["samples_per_s_is"] = throughput.definition(summary["lockstep"])
    return run


def run_config(run: Run) -> Config:
    """The run's resolved configuration as a Config (what theory.predict reads)."""
    if not run["config"]:
        raise FileNotFoundError(f"{run['path']}: no config.json")
    return from_record(run["config"])


def label(run: Run) -> str:
    """'run (architecture N=..)' for warnings (the architecture's label says its servers)."""
    s = run["summary"]
    return f"{run['run_label']} ({s['label']} N={s['world_size']})"


def name_runs(runs: list[Run]) -> None:
    """Set each run's `run_label`, its name in tables and plots: the config's `label`, else its folder's name,
    never the config's `name` that several runs share. Where two would read the same, a folder's name takes
    its parent folders until they differ, and a label its folder after it; one folder given twice, a number."""
    keys = [(Path(r["path"]).resolve().parts[1:], (r["config"] or {}).get("label") or "") for r in runs]
    distinct = list(dict.fromkeys(keys))

    def name(key: tuple[tuple[str, ...], str], depth: int) -> str:
        folders, given = "/".join(key[0][-depth:]), key[1]
        return folders if not given else given if depth == 0 else f"{given} ({folders})"

    depth = {k: 0 if k[1] else 1 for k in distinct}
    while True:
        names = {k: name(k, depth[k]) for k in distinct}
        clash = [k for k in distinct if list(names.values()).count(names[k]) > 1 and depth[k] < len(k[0])]
        if not clash:
            break
        for k in clash:
            depth[k] += 1
    for i, (run, key) in enumerate(zip(runs, keys)):
        same = [j for j, k in enumerate(keys) if k == key]
        run["run_label"] = names[key] + (f" #{same.index(i) + 1}" if len(same) > 1 else "")


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the window - 1 before it: one small batch's loss is too noisy to read alone."""
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def step_clock(rows: list[MetricsRow]) -> list[float]:
    """Wall-clock time of steps: the running sum of each metrics row's step time."""
    return list(itertools.accumulate(r["step_time_s"] for r in rows))


def worker_sent_per_step(summary: Summary) -> float:
    """Bytes one worker sent per step, mean over the ranks (every training role's nodes) of each one's."""
    return nodes.ranks_mean(summary, "sent")[0] or 0.0


def predicted_worker_sent(summary: Summary) -> float:
    """Theory's bytes one worker sends per step, as worker_sent_per_step measures them: the mean over the ranks
    of each one's (its role's)."""
    return nodes.ranks_mean(summary, "sent")[1] or 0.0


def predicted_rank0_memory(summary: Summary) -> float:
    """Theory's model-state bytes of rank 0 (its role's)."""
    return float(nodes.predicted_of_rank(summary, 0)["memory"]["total"])


def workload_of(run: Run) -> str:
    """What a run trains: its factory ("package.module:function") or its built-in model/data."""
    return (run["config"].get("workload") or {}).get("factory") or run["summary"].get("workload") or "?"


def default_fraction() -> float:
    """The config key `convergence_target`'s default."""
    return cast(float, next(f.default for f in dataclasses.fields(Config) if f.name == "convergence_target"))


def fraction_of(run: Run) -> float:
    """The run's config key `convergence_target` (its default where the run predates it)."""
    return (run["config"] or {}).get("convergence_target", default_fraction())


def target_fraction(runs: list[Run]) -> float:
    """The fraction of the initial gap a report's target is: the first run's convergence_target (one for the
    report; compare warns where runs set another)."""
    return fraction_of(runs[0]) if runs else default_fraction()


def target_gaps(runs: list[Run], absolute: float | None = None) -> list[float | None]:
    """The gap each run must fall below to count as converged: `absolute` where given, else target_fraction of
    its workload's initial gap, so that the target means as much on every workload and is one for all runs
    of a workload. The initial gap: the first step's loss less the floor, of a run that starts at step 0,
    in lockstep where there is one (its first step is the initial model's loss on the whole global batch).
    None for a run without a floor or metrics."""
    def key(run: Run) -> tuple[str, float | None]:
        return workload_of(run), run["summary"].get("entropy_floor")

    start: dict[tuple[str, float | None], float] = {}
    for run in sorted(runs, key=lambda r: (bool(r["metrics"]) and r["metrics"][0]["step"] != 0,
                                           not r["summary"].get("lockstep", True))):
        floor = key(run)[1]
        if floor is not None and run["metrics"]:
            start.setdefault(key(run), run["metrics"][0]["loss"] - floor)
    if absolute is not None:
        return [absolute if key(r) in start else None for r in runs]
    fraction = target_fraction(runs)
    return [fraction * start[key(r)] if key(r) in start else None for r in runs]


def target_words(absolute: float | None, fraction: float | None = None) -> str:
    """How a report states its convergence target (`fraction`: target_fraction's, else the key's default)."""
    if absolute is not None:
        return f"{absolute:g}"
    return f"{fraction if fraction is not None else default_fraction():g} x the workload's initial gap"


Row = TypeVar("Row")
NO_EMULATED_RUN = "no run of an emulated cluster (summary.json with cluster.emulated) in it"


def sweep_rows(folder: Path, collect: Callable[[Path], list[Row]], missing: str) -> list[Row]:
    """The rows of a study's table (`psarch report NAME SWEEP`), collected from a sweep folder; where it is no
    folder, or holds no such run (`missing` says which), the command stops in one line."""
    if not folder.is_dir():
        sys.exit(f"{folder}: not a folder")
    found = collect(folder)
    if not found:
        sys.exit(f"{folder}: {missing}")
    return found


def publish(folder: Path, name: str, text: str) -> None:
    """A study's table written into its sweep folder as `name`, and printed."""
    (folder / name).write_text(text)
    print(text, end="")

