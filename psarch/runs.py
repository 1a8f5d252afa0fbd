"""A finished run folder read back, and the figures derived from it that `compare`, the plots and
`estimate --from` all show (each computed here once)."""
from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from psarch.config import Config, from_dict
from psarch.outputs import identity
from psarch.theory import predict


def load_run(path: str | Path) -> dict[str, Any]:
    """A finished run folder's summary, config (as written) and per-step metrics; the summary's `predicted` is
    theory.predict's for the run's config. A failed or interrupted run raises ValueError (one line)."""
    path = Path(path)
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        raise FileNotFoundError(f"{path}: not a run folder (no summary.json)")
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()] \
        if (path / "metrics.jsonl").is_file() else []
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    summary = json.loads(summary_path.read_text())
    if summary.get("status", "finished") != "finished":   # a stopped run's summary has no figures
        raise ValueError(f"{path}: the run {summary['status']} ({summary.get('error') or 'no error recorded'}); "
                         f"no figures to load")
    run = {"path": str(path), "summary": summary, "config": config, "metrics": rows}
    if config:  # theory and names as they stand now, not as they stood when the run was made
        cfg = run_config(run)
        summary["predicted"] = predict(cfg, summary["params"]).to_dict()
        summary.update({k: v for k, v in identity(cfg).items() if k in ("variant", "label", "lockstep")})
    return run


def run_config(run: dict[str, Any]) -> Config:
    """The run's resolved configuration as a Config (what theory.predict reads)."""
    if not run["config"]:
        raise FileNotFoundError(f"{run['path']}: no config.json")
    return from_dict(run["config"])


def label(run: dict[str, Any]) -> str:
    """'name: architecture N=..' for tables and tick labels (the architecture's label says its servers)."""
    s = run["summary"]
    return f"{s['name']}: {s['label']} N={s['world_size']}"


def short_names(runs: list[dict[str, Any]]) -> list[str]:
    """Run names without their common sweep prefix ("sweep/"), for legends and ticks."""
    names = [r["summary"]["name"] for r in runs]
    prefixes = {n.rsplit("/", 1)[0] for n in names if "/" in n}
    if len(prefixes) == 1 and all("/" in n for n in names):
        return [n.rsplit("/", 1)[1] for n in names]
    return names


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the window - 1 before it: one small batch's loss is too noisy to read alone."""
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def step_clock(rows: list[dict[str, Any]]) -> list[float]:
    """Wall-clock time of steps: the running sum of each metrics row's step time."""
    return list(itertools.accumulate(r["step_time_s"] for r in rows))


def worker_sent_per_step(summary: dict[str, Any]) -> float:
    """Bytes one worker sent per step, mean over workers of each one's `sent_per_step`."""
    tr = summary["traffic"]["per_rank"]
    return sum(t["sent_per_step"] for t in tr) / len(tr)


def predicted_worker_sent(summary: dict[str, Any]) -> float:
    """Theory's bytes one worker sends per step, as worker_sent_per_step measures them: the mean over the
    ranks where ranks differ (Prediction.per_rank), else every worker's."""
    p = summary["predicted"]
    if p.get("per_rank"):
        return sum(r["sent"] for r in p["per_rank"]) / len(p["per_rank"])
    return p["traffic_per_step"]["worker_sent"]


def predicted_rank0_memory(summary: dict[str, Any]) -> float:
    """Theory's model-state bytes of rank 0 (its own where ranks differ)."""
    p = summary["predicted"]
    return p["per_rank"][0]["memory"]["total"] if p.get("per_rank") else p["memory_per_rank"]["total"]


def server_received_per_step(summary: dict[str, Any]) -> float | None:
    """Bytes one PS server received per step: the servers' run totals (set-up included), mean over
    servers, divided by the steps; None without servers."""
    servers = summary.get("traffic", {}).get("servers") or []
    if not servers:
        return None
    return sum(x["received"] for x in servers) / len(servers) / max(1, summary["steps"])


def server_memory(summary: dict[str, Any]) -> list[float]:
    """Each PS server's model-state bytes (its parameter range and optimizer state); [] without servers."""
    return [m["total"] for m in summary.get("memory", {}).get("servers") or []]


def system_memory(summary: dict[str, Any]) -> float:
    """Model-state bytes of the whole system: every worker's plus every server's."""
    return sum(m["total"] for m in summary["memory"]["per_rank"]) + sum(server_memory(summary))


def predicted_system_memory(summary: dict[str, Any]) -> float:
    """Theory's model-state bytes of the whole system: N workers' plus the servers'."""
    p = summary["predicted"]
    servers = summary.get("servers") or 0
    workers = sum(r["memory"]["total"] for r in p["per_rank"]) if p.get("per_rank") else \
        summary["world_size"] * p["memory_per_rank"]["total"]
    return workers + servers * (p.get("server_memory") or 0.0)
