"""Sweeps: a config's `[sweep]` table declares a matrix of overrides; `psarch run` runs every point.

    [sweep]
    backend = ["ddp", "zero", "ps"]         # short for "backend.kind"
    "backend.stage" = [1, 2, 3]
    "backend.world_size" = [2, 4]
    points = [{ "backend.kind" = "single", "backend.world_size" = 1 }]   # optional explicit points

Points = explicit points (or one empty point) x the matrix. Keys that do not apply to a point's backend
(e.g. `backend.stage` for ddp, `backend.k_steps` for ps sync: psarch.config.applies) are dropped, and points
that are then identical run once (the sweep says which). Every option the file itself, --set, an axis or a
point names must apply to at least one point. --set has the last word over the sweep too: an axis it sets is
narrowed to its value, and an explicit point that sets it takes its value (`narrowed`). Each point writes its own run folder
under the sweep's folder; a point whose folder holds a finished run of the same resolved config (config.json)
is skipped unless rerun, and otherwise runs again with the reason printed; a failed point is
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

from psarch.config import (REPORT_ONLY, Config, ConfigError, applies, applies_to, check_machine, explicit_keys,
                           load_config, parse_override, top_table)
from psarch.launch.outputs import run_folder
from psarch.records import Summary

ALIASES = {"backend": "backend.kind"}


def _dotted(key: str) -> str:
    """A sweep key as the config's dotted key (ALIASES: `backend` is backend.kind)."""
    return ALIASES.get(key, key)


@dataclass
class Point:
    name: str
    overrides: dict[str, Any]
    error: str | None = None          # a config error (run_sweep refuses to start while any point has one)
    status: str = "pending"           # pending | done | skipped | failed
    detail: str = ""
    same_as: list[str] = field(default_factory=list)   # combinations that are this point once dropped keys go
    summary: Summary = field(default_factory=lambda: Summary())


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


def narrowed(sweep: dict[str, Any], overrides: list[str] | None) -> tuple[dict[str, Any], list[str]]:
    """The sweep with every axis and explicit point that sets a key `--set` also sets narrowed to the --set
    value (the command line has the last word, as over the file), and one line per axis saying so."""
    pinned = {".".join(path): value for path, value in (parse_override(o) for o in overrides or [])}
    out, notes = {}, []
    for k, v in sweep.items():
        key = _dotted(k)
        if k == "points" and isinstance(v, list):
            keys = sorted({_dotted(pk) for p in v if isinstance(p, dict) for pk in p} & pinned.keys())
            notes += [f"--set {key}={json.dumps(pinned[key])} replaces {key} in every sweep point that sets it"
                      for key in keys]
            v = [{pk: pinned.get(_dotted(pk), pv) for pk, pv in p.items()} if isinstance(p, dict) else p
                 for p in v]
        elif key in pinned and k not in ("points", "rerun"):
            notes.append(f"--set {key}={json.dumps(pinned[key])} narrows the sweep axis {key} = "
                         f"{json.dumps(v, default=str)} to [{json.dumps(pinned[key])}]")
            v = [pinned[key]]
        out[k] = v
    return out, notes


def expand(path: str | Path, sweep: dict[str, Any], overrides: list[str] | None = None) -> list[Point]:
    """Every distinct point of the sweep (narrowed by --set: `narrowed`), validated (a point with a bad config
    carries its error)."""
    sweep = dict(narrowed(sweep, overrides)[0])
    explicit = sweep.pop("points", [{}])
    sweep.pop("rerun", None)
    axes = {_dotted(k): v for k, v in sweep.items()}
    for k, v in axes.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"sweep.{k} = {json.dumps(v, default=str)}: expected a non-empty list of values")
    if not isinstance(explicit, list) or not all(isinstance(p, dict) for p in explicit):
        raise ConfigError("sweep.points: expected a list of tables of overrides")
    points: dict[str, Point] = {}  # by the point's kept overrides
    probed: dict[str, str | None] = {}   # the machine's emulation probe, once for every point
    used: dict[str, bool] = {k: False for k in explicit_keys(top_table(Path(path)), overrides)}
    for base in explicit:
        base = {_dotted(k): v for k, v in base.items()}
        for combo in itertools.product(*axes.values()):
            ov = {**base, **dict(zip(axes, combo))}
            try:
                cfg = load_config(path, point_overrides(overrides, ov))
            except ConfigError as e:  # reported as the point's error; it still counts as a point
                points.setdefault(json.dumps(ov, sort_keys=True, default=str), Point(_point_name(ov), ov, error=str(e)))
                continue
            for k in list(used) + list(ov):
                used[k] = used.get(k, False) or applies(k, cfg)
            kept = {k: v for k, v in ov.items() if applies(k, cfg)}
            key = json.dumps(kept, sort_keys=True, default=str)
            if key in points:
                if kept != ov:
                    points[key].same_as.append(_point_name(ov))
                continue
            points[key] = Point(_point_name(kept), kept)
            try:
                check_machine(load_config(path, point_overrides(overrides, kept)), probed)
            except ConfigError as e:
                points[key].error = str(e)
    unused = [k for k, hit in used.items() if not hit]
    if unused and not any(p.error for p in points.values()):  # a point's own error says more
        raise ConfigError(f"{unused[0]}: applies only to {applies_to(unused[0])}; no point of this sweep runs such "
                          f"a backend (remove the option or add such a point)")
    return list(points.values())


def duplicates_note(points: list[Point]) -> str:
    """One line naming the combinations that ran as another point (options that do not apply dropped)."""
    same = [f"{', '.join(p.same_as)} = {p.name}" for p in points if p.same_as]
    return f"identical once options that do not apply are dropped, run once: {'; '.join(same)}" if same else ""


def point_overrides(overrides: list[str] | None, ov: dict[str, Any]) -> list[str]:
    """The command line's overrides, then the point's."""
    return list(overrides or []) + [f"{k}={json.dumps(v)}" for k, v in ov.items()]


def _why_run_again(folder: Path, cfg: Any) -> str | None:
    """None when `folder` holds a finished run of exactly this config; else why the point must run."""
    try:
        stored = json.loads((folder / "config.json").read_text())
        status = json.loads((folder / "summary.json").read_text()).get("status", "finished")
    except (OSError, ValueError):
        return "no run yet"
    if status != "finished":
        return f"the last run {status}"
    flat_old, flat_new = _flatten(stored), _flatten(json.loads(json.dumps(cfg.to_dict())))  # as stored
    changed = sorted(k for k in flat_old.keys() | flat_new.keys()
                     if flat_old.get(k, "?") != flat_new.get(k, "?") and k not in REPORT_ONLY)
    if changed:
        k = changed[0]
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        return f"its config changed: {k} = {json.dumps(flat_old.get(k))} -> {json.dumps(flat_new.get(k))}{more}"
    return None


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def _refuse_before_starting(points: list[Point], start: str | Path | None) -> None:
    """As for a single run, a config error (or an unreadable --from) stops the sweep before any process
    starts: one line, not one failed point each."""
    bad = [p for p in points if p.error]
    if bad:
        more = f" (and {len(bad) - 1} more points with config errors)" if len(bad) > 1 else ""
        raise ConfigError(f"sweep point {bad[0].name}: {bad[0].error}{more}")
    if start is not None:
        from psarch.checkpoint import Checkpoint, CheckpointError
        try:
            Checkpoint(start).verify()
        except CheckpointError as e:
            raise ConfigError(f"--from: {e}") from None


def _run_point(p: Point, cfg: Config, root: Path, echo: bool, start: str | Path | None, progress: bool) -> None:
    """Run one point into root/<name>, recording its status; a failure is kept (traceback in <name>.error)
    and does not stop the other points."""
    from psarch.launch.ranks import run

    t0 = time.perf_counter()
    try:
        p.summary = run(cfg, root / p.name, echo=echo, machine_checked=True, start=start,   # expand checked it
                        progress=progress)
        p.status, p.detail = "done", f"{time.perf_counter() - t0:.1f} s"
    except Exception as e:
        p.status = "failed"
        p.detail = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        (root / f"{p.name}.error").write_text(traceback.format_exc())


def run_sweep(path: str | Path, sweep: dict[str, Any], overrides: list[str] | None = None,
              out: str | Path | None = None, rerun: bool = False, echo: bool = True,
              start: str | Path | None = None, progress: bool = True) -> list[Point]:
    """Run every point (skipping finished ones unless rerun), then compare them. Returns the points. With
    `start` (--from), every point forks that checkpoint and runs (a finished point does not record its start).
    echo: print the sweep's lines and each point's summary; progress: also each point's progress lines."""
    from psarch.report.compare import compare

    base = load_config(path, overrides)
    root = run_folder(base, out)
    points = expand(path, sweep, overrides)
    _refuse_before_starting(points, start)
    root.mkdir(parents=True, exist_ok=True)
    if echo:
        for note in narrowed(sweep, overrides)[1]:
            print(f"sweep: {note}", flush=True)
    if echo and duplicates_note(points):
        print(f"sweep: {len(points)} points; {duplicates_note(points)}", flush=True)
    for i, p in enumerate(points):
        folder = root / p.name
        if echo:
            print(f"\n{_bar(i, len(points))}  point {p.name}", flush=True)
        cfg = load_config(path, point_overrides(overrides, p.overrides))
        cfg.name = f"{base.name}/{p.name}"
        stale = "rerun asked" if rerun else "forks --from" if start is not None else _why_run_again(folder, cfg)
        if stale is None:
            p.status, p.detail = "skipped", "finished with the same config (--rerun to run it again)"
            p.summary = json.loads((folder / "summary.json").read_text())
        else:
            if echo and stale not in ("no run yet", "forks --from"):
                print(f"point {p.name}: running it again: {stale}", flush=True)
            _run_point(p, cfg, root, echo=echo, start=start, progress=progress)
        if echo:
            print(f"{_bar(i + 1, len(points))}  point {p.name}: {p.status} ({p.detail})", flush=True)
    (root / "sweep.json").write_text(json.dumps(
        [{"name": p.name, "overrides": p.overrides, "status": p.status, "detail": p.detail, "same_as": p.same_as}
         for p in points],
        indent=2) + "\n")
    if any(p.status in ("done", "skipped") for p in points):
        report = compare([root], root / "compare")   # the sweep folder: its failed points listed, and counted by seed
        if echo:
            print(f"\ncomparison: {report}")
    if echo:
        for p in points:
            if p.status == "failed":
                print(f"FAILED point {p.name}: {p.detail}")
    return points
