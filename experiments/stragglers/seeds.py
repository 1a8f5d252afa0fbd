"""README's stragglers table: every (run, slowdown, jitter) over its seeds, mean ± 95% CI (psarch.seeds), from
psarch.report.stragglers' rows (samples/s as the summary defines it; time to the target gap with every
worker's losses at its own clock):
    python experiments/stragglers/seeds.py runs/stragglers > experiments/stragglers/results/seeds.md
and with the runs that overran more than 5% of their steps replaced by their runs at a fixed D (fixed_d.toml):
    python experiments/stragglers/seeds.py runs/stragglers runs/stragglers_fixed_d > \
        experiments/stragglers/results/seeds_fixed_d.md"""
import sys
from itertools import groupby
from pathlib import Path

from psarch.report.stragglers import rows
from psarch.report.seeds import interval


def ci(xs: list, form: str) -> str:
    i = interval(xs)
    if i is None:
        return "-"
    if i.n == 1:
        return f"{i.mean:{form}} (n = 1)"
    return f"{i.mean:{form}}" if float(f"{i.half:{form}}") == 0 else f"{i.mean:{form}} ± {i.half:{form}}"


rs = rows(Path(sys.argv[1]))
if len(sys.argv) > 2:   # runs of the sweep made again in a second folder (fixed_d.toml): each replaces its namesake
    again = {r["run"]: r for r in rows(Path(sys.argv[2]))}
    rs = [again.get(r["run"], r) for r in rs]
gaps = {r["target_gap"] for r in rs}
print(f"| run | slowdown of worker 0 | jitter | seeds | samples/s | predicted (lockstep) | time to half the initial "
      f"gap ({', '.join(sorted({f'{g:.2f}' for g in gaps}))}) (s) | reached | final gap | D | overrun steps |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
key = lambda r: (r["jitter"], r["slowdown"], r["mode"])   # noqa: E731
for (jitter, slowdown, mode), group in groupby(sorted(rs, key=key), key=key):
    g = list(group)
    reached = [r["time_to_gap"] for r in g if r["time_to_gap"] is not None]
    pred = [r["predicted"] for r in g if r["predicted"] is not None]
    ds = [r["dilation"] for r in g]
    print(f"| {mode} | {slowdown:g}x | {jitter:g} | {len(g)} | {ci([r['samples_per_s'] for r in g], '.0f')} | "
          f"{ci(pred, '.0f') if pred else ''} | {ci(reached, '.1f')} | {len(reached)} of {len(g)} | "
          f"{ci([r['final_gap'] for r in g], '.3f')} | {min(ds):g}-{max(ds):g} | "
          f"{max(r['overrun'] for r in g):.0%} at most |")
