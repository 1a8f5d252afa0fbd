"""Issue 22's targets, read from the run folders (summary.json) of the virtual-device experiments:
    python experiments/stragglers/targets.py runs > experiments/stragglers/results/targets.md"""
import json
import sys
from pathlib import Path

from psarch.cluster.device import OVERRUN_WARN
from psarch.report.seeds import interval   # the Seeds table's own mean and 95% CI

runs = Path(sys.argv[1])


def summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def seeds(point: str) -> list[dict]:
    return [summary(f) for f in sorted((runs / "stragglers").glob(f"{point}-seed*")) if (f / "summary.json").exists()]


def ci(xs: list[float]) -> str:
    i = interval(xs)
    return f"{i.mean:.2f} ± {i.half:.2f} (n = {i.n})" if i.n > 1 else f"{i.mean:.2f} (n = 1)"


def ratios(points: list[dict], to: list[dict]) -> list[float]:
    """samples/s of each run of `points` over that of the run of `to` with the same seed."""
    by_seed = {r["name"].rsplit("-seed", 1)[1]: r["samples_per_s"] for r in to}
    return [r["samples_per_s"] / by_seed[k] for r in points if (k := r["name"].rsplit("-seed", 1)[1]) in by_seed]


def ratio_row(words: str, xs: list[float], goal: str) -> str:
    measured = f"{ci(xs)}; {', '.join(f'{r:.2f}' for r in xs)}" if xs else "no runs"
    return f"| {words} | {measured} | {goal} |"


sync, async_, ring, ssp, geo = (seeds(f"{p}-slowdown4.0-jitter0.0") for p in (
    "ps-modesync", "ps-modeasync", "ddp-commring", "ps-modessp-staleness_bound2", "ps-modegeo-k_steps4"))
print("| target | measured | goal |\n|---|---|---|")
print(ratio_row("one worker of 4 at 4x: PS async / sync samples/s (per seed)", ratios(async_, sync),
                ">= 2.5 (ideal 3.25)"))
# SSP: a fast worker may be at most staleness_bound steps ahead of the slowest, so past its first few steps it
# waits for the straggler every step: its median step is the straggler's, as in sync (ideal 1).
print(ratio_row("one worker of 4 at 4x: PS SSP (bound 2) / sync samples/s (per seed)", ratios(ssp, sync),
                "ideal 1 (the slowest worker sets every step once the bound is reached)"))
# GEO without barrier: workers never wait for each other, and 3 of every 4 steps send nothing, so a worker's median
# step is its modelled compute alone: ideal shard x (3 / T + 1 / 4T) samples/s, against sync's measured step (which
# pays its exchange every step) rather than against sync's compute alone (3.25).
step = {id(r): r["virtual_device"]["forward_s"] + r["virtual_device"]["backward_s"] for r in sync}   # T, unslowed
geo_ideal = [r["global_batch"] / 4 * (3 + 1 / 4) / step[id(r)] / r["samples_per_s"] for r in sync]
print(ratio_row("one worker of 4 at 4x: PS GEO (k = 4) / sync samples/s (per seed)", ratios(geo, sync),
                f"ideal 3.25 with free communication; {ci(geo_ideal)} against sync's measured step"))
print(ratio_row("one worker of 4 at 4x: PS GEO (k = 4) / async samples/s (per seed)", ratios(geo, async_),
                "ideal 1, above 1 by async's exchange each step that GEO makes every 4th"))
bound = [r["samples_per_s"] / (r["global_batch"] / r["cluster"]["step_time"]["predicted_s"]) - 1 for r in ring]
if bound:
    print(f"| ring DDP at 4x against the slowest-worker bound (measured / predicted - 1) | "
          f"{', '.join(f'{b:+.1%}' for b in bound)} | within 10% |")
if (runs / "stragglers_repeat" / "summary.json").exists():
    rep, first = summary(runs / "stragglers_repeat"), sync[0]
    print(f"| two runs of one emulated config (ps sync 4x seed 0): samples/s | {first['samples_per_s']:.1f} and "
          f"{rep['samples_per_s']:.1f}: {rep['samples_per_s'] / first['samples_per_s'] - 1:+.1%} | within 3% |")
for f in sorted((runs / "cluster_crossover_device").glob("*world_size8*")):
    if (f / "summary.json").exists():
        vd = summary(f)["virtual_device"]
        print(f"| 8 workers, {f.name}: overrun steps | {vd['overrun_steps']} of {vd['counted_steps']} "
              f"({vd['overrun_fraction']:.1%}), D = {vd['dilation']:g} | < 5% |")
named = {f.name: summary(f)["virtual_device"] for f in sorted((runs / "stragglers").glob("*-seed*"))
         if (f / "summary.json").exists()}
every = list(named.values())
print(f"| stragglers, every run: overrun steps | {sum(v['overrun_steps'] for v in every)} of "
      f"{sum(v['counted_steps'] for v in every)}; worst run {max(v['overrun_fraction'] for v in every):.1%}; "
      f"D {min(v['dilation'] for v in every):g}-{max(v['dilation'] for v in every):g} | < 5% |")
over = [f"{name} ({v['overrun_fraction']:.1%}, D = {v['dilation']:g})" for name, v in named.items()
        if v["overrun_fraction"] > OVERRUN_WARN]
print(f"| stragglers, runs over {OVERRUN_WARN:.0%} overrun | {'; '.join(over) or 'none'} | none |")
