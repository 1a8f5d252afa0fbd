"""Studies with repeated seeds: runs whose configs differ only in `seed` (a sweep axis `"seed" = [0, 1, 2]`)
form a group, and compare reports each group's mean and 95% confidence interval (Student's t over the seeds)
of what decides a study — final gap, steps and time to the target gap, samples/s — and how many diverged."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from typing import Any

from psarch.report.runs import Run

# config keys that do not change what a run is, besides its seed: its name, folder, display label, provenance,
# the target its report measures it against
NOT_THE_RUN = ("seed", "name", "out", "label", "started_from", "convergence_target")

# Student's t, two-sided 95%, by degrees of freedom (n - 1); 1.96 beyond the table
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (table values, interpolated downwards)."""
    if df < 1:
        raise ValueError(f"degrees of freedom {df}: need at least 2 samples for an interval")
    known = [d for d in _T975 if d <= df]
    return _T975[max(known)] if df <= 30 else 1.96


@dataclass(frozen=True)
class Interval:
    """A mean and the half-width of its 95% confidence interval over n samples (nan with one sample)."""

    mean: float
    half: float
    n: int

    def __str__(self) -> str:
        digits = 4 if abs(self.mean) < 10 else 1
        if self.n < 2:
            return f"{self.mean:.{digits}f} (n=1)"
        return f"{self.mean:.{digits}f} ± {self.half:.{digits}f} (n={self.n})"


def interval(values: list[float]) -> Interval | None:
    """Mean ± t·s/√n of the finite values; None when there are none."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return None
    if len(xs) == 1:
        return Interval(xs[0], math.nan, 1)
    return Interval(statistics.fmean(xs), t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)), len(xs))


def study_key(run: Run) -> str:
    """What a run is, but for its seed (and name, folder, label): runs with one key form a seed group."""
    return config_key(run["config"])


def config_key(config: dict[str, Any] | None) -> str:
    """study_key of a run's config.json (None or {}: a run without one)."""
    return json.dumps({k: v for k, v in (config or {}).items() if k not in NOT_THE_RUN}, sort_keys=True, default=str)


def seed_groups(runs: list[Run]) -> list[list[Run]]:
    """The runs grouped by study_key, in the order each group's first run comes. Only runs of distinct seeds
    form a study: a group where a seed repeats (the same config run twice) stays apart, a run each."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(study_key(run), []).append(run)
    out = []
    for group in groups.values():
        seeds = [(r["config"] or {}).get("seed") for r in group]
        out += [group] if len(set(seeds)) == len(seeds) else [[r] for r in group]
    return out
