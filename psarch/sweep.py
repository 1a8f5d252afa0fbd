"""Sweeps: a config's `[sweep]` table declares a matrix of overrides; `psarch run` runs every point.

    [sweep]
    backend = ["ddp", "zero", "ps"]         # short for "backend.kind"
    "backend.stage" = [1, 2, 3]
    "backend.world_size" = [2, 4]
    points = [{ "backend.kind" = "single", "backend.world_size" = 1 }]   # optional explicit points

Points = explicit points (or one empty point) x the matrix. Keys that do not apply to a point's backend
(e.g. `backend.stage` for ddp) are dropped, so duplicates run once. Each point writes its own run folder
under the sweep's folder; a point whose summary.json exists is skipped unless rerun; a failed point is
reported and the others still run; the comparison of all finished points is written at the end. A point
with a config error stops the sweep before any point runs.
"""
from __future__ import annotations

import itertools
import json
import time
import tomllib
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psarch.config import ConfigError, check_machine, load_config

# Options that only some backends read; elsewhere they are dropped from a point.
APPLIES_TO = {
    "backend.comm": {"ddp", "zero"},
    "backend.bucket_cap_mb": {"ddp", "torch_ddp", "torch_zero"},
    "backend.stage": {"zero"}, "backend.reduce_bucket_size": {"zero"}, "backend.allgather_bucket_size": {"zero"},
    "backend.prefetch_bucket_size": {"zero"}, "backend.activation_checkpointing": {"zero"},
    "backend.mode": {"ps"}, "backend.servers": {"ps"}, "backend.k_steps": {"ps"}, "backend.geo_barrier": {"ps"},
    "backend.staleness_bound": {"ps"}, "backend.staleness_compensation": {"ps"}, "backend.dc_lambda": {"ps"},
}
ALIASES = {"backend": "backend.kind"}


@dataclass
class Point:
    name: str
    overrides: dict[str, Any]
    error: str | None = None          # a config error (run_sweep refuses to start while any point has one)
    status: str = "pending"           # pending | done | skipped | failed
    detail: str = ""
    summary: dict[str, Any] = field(default_factory=dict)


def read_sweep(path: str | Path) -> dict[str, Any] | None:
    """The `[sweep]` table of a config file (not of its bases), or None."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None  # load_config reports these properly
    sweep = data.get("sweep")
    if sweep is not None and not isinstance(sweep, dict):
        raise ConfigError(f"sweep = {json.dumps(sweep, default=str)}: expected a table [sweep] whose keys are "
                          f"config keys with lists of values (and optional points = [{{...}}, ...])")
    return sweep


def _point_name(ov: dict[str, Any]) -> str:
    parts = []
    for k, v in ov.items():
        short = k.split(".")[-1]
        parts.append(str(v) if short == "kind" else f"{short}{v}")
    name = "-".join(parts) or "base"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def expand(path: str | Path, sweep: dict[str, Any], overrides: list[str] | None = None) -> list[Point]:
    """Every distinct point of the sweep, validated (a point with a bad config carries its error)."""
    sweep = dict(sweep)
    explicit = sweep.pop("points", [{}])
    sweep.pop("rerun", None)
    axes = {ALIASES.get(k, k): v for k, v in sweep.items()}
    for k, v in axes.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"sweep.{k} = {json.dumps(v, default=str)}: expected a non-empty list of values")
    if not isinstance(explicit, list) or not all(isinstance(p, dict) for p in explicit):
        raise ConfigError("sweep.points: expected a list of tables of overrides")
    default_kind = load_config(path, overrides).backend.kind
    points, seen = [], set()
    for base in explicit:
        base = {ALIASES.get(k, k): v for k, v in base.items()}
        for combo in itertools.product(*axes.values()):
            ov = {**base, **dict(zip(axes, combo))}
            kind = ov.get("backend.kind", default_kind)
            ov = {k: v for k, v in ov.items() if kind in APPLIES_TO.get(k, {kind})}
            name = _point_name(ov)
            if name in seen:
                continue
            seen.add(name)
            try:
                check_machine(load_config(path, point_overrides(overrides, ov)))
                points.append(Point(name, ov))
            except ConfigError as e:
                points.append(Point(name, ov, error=str(e)))
    return points


def point_overrides(overrides: list[str] | None, ov: dict[str, Any]) -> list[str]:
    """The command line's overrides, then the point's."""
    return list(overrides or []) + [f"{k}={json.dumps(v)}" for k, v in ov.items()]


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def run_sweep(path: str | Path, sweep: dict[str, Any], overrides: list[str] | None = None,
              out: str | Path | None = None, rerun: bool = False, echo: bool = True) -> list[Point]:
    """Run every point (skipping finished ones unless rerun), then compare them. Returns the points."""
    from psarch.compare import compare
    from psarch.launch import run

    base = load_config(path, overrides)
    root = Path(out or base.out or Path("runs") / base.name)
    points = expand(path, sweep, overrides)
    bad = [p for p in points if p.error]
    if bad:  # as for a single run: a config error stops everything before any process starts
        more = f" (and {len(bad) - 1} more points with config errors)" if len(bad) > 1 else ""
        raise ConfigError(f"sweep point {bad[0].name}: {bad[0].error}{more}")
    root.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(points):
        folder = root / p.name
        if echo:
            print(f"\n{_bar(i, len(points))}  point {p.name}", flush=True)
        if (folder / "summary.json").is_file() and not rerun:
            p.status, p.detail = "skipped", "outputs exist (rerun to replace)"
            p.summary = json.loads((folder / "summary.json").read_text())
        else:
            cfg = load_config(path, point_overrides(overrides, p.overrides))
            cfg.name = f"{base.name}/{p.name}"
            t0 = time.perf_counter()
            try:
                p.summary = run(cfg, folder, echo=echo)
                p.status, p.detail = "done", f"{time.perf_counter() - t0:.1f} s"
            except Exception as e:  # one failed point must not stop the others
                p.status = "failed"
                p.detail = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                (root / f"{p.name}.error").write_text(traceback.format_exc())
        if echo:
            print(f"{_bar(i + 1, len(points))}  point {p.name}: {p.status} ({p.detail})", flush=True)
    (root / "sweep.json").write_text(json.dumps(
        [{"name": p.name, "overrides": p.overrides, "status": p.status, "detail": p.detail} for p in points],
        indent=2) + "\n")
    finished = [root / p.name for p in points if p.status in ("done", "skipped")]
    if finished:
        report = compare(finished, root / "compare")
        if echo:
            print(f"\ncomparison: {report}")
    if echo:
        for p in points:
            if p.status == "failed":
                print(f"FAILED point {p.name}: {p.detail}")
    return points
