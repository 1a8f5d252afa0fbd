"""Issue 22's targets, read from the run folders (summary.json) of the virtual-device experiments:
    python experiments/results/stragglers/targets.py runs > experiments/results/stragglers/targets.md"""
import json
import statistics
import sys
from pathlib import Path

from psarch.seeds import interval   # the Seeds table's own mean and 95% CI

runs = Path(sys.argv[1])


def summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def seeds(point: str) -> list[dict]:
    return [summary(f) for f in sorted((runs / "stragglers").glob(f"{point}-seed*")) if (f / "summary.json").exists()]


def ci(xs: list[float]) -> str:
    i = interval(xs)
    return f"{i.mean:.2f} ± {i.half:.2f} (n = {i.n})" if i.n > 1 else f"{i.mean:.2f} (n = 1)"


sync, async_, ring = (seeds(f"{p}-slowdown4.0-jitter0.0") for p in ("ps-modesync", "ps-modeasync", "ddp-commring"))
ratios = [a["samples_per_s"] / s["samples_per_s"] for s, a in zip(sync, async_)]
print("| target | measured | goal |\n|---|---|---|")
print(f"| one worker of 4 at 4x: PS async / sync samples/s (per seed) | {ci(ratios)}; "
      f"{', '.join(f'{r:.2f}' for r in ratios)} | >= 2.5 (ideal 3.25) |")
bound = [r["samples_per_s"] / (r["global_batch"] / r["cluster"]["step_time"]["predicted_s"]) - 1 for r in ring]
print(f"| ring DDP at 4x against the slowest-worker bound (measured / predicted - 1) | "
      f"{', '.join(f'{b:+.1%}' for b in bound)} | within 10% |")
over = [r["virtual_device"]["overrun_fraction"] for r in sync + async_ + ring]
if (runs / "stragglers_repeat" / "summary.json").exists():
    rep, first = summary(runs / "stragglers_repeat"), sync[0]
    print(f"| two runs of one emulated config (ps sync 4x seed 0): samples/s | {first['samples_per_s']:.1f} and "
          f"{rep['samples_per_s']:.1f}: {rep['samples_per_s'] / first['samples_per_s'] - 1:+.1%} | within 3% |")
for f in sorted((runs / "cluster_crossover_device").glob("*world_size8*")):
    if (f / "summary.json").exists():
        vd = summary(f)["virtual_device"]
        print(f"| 8 workers, {f.name}: overrun steps | {vd['overrun_steps']} of {vd['counted_steps']} "
              f"({vd['overrun_fraction']:.1%}), D = {vd['dilation']:g} | < 5% |")
every = [summary(f)["virtual_device"] for f in sorted((runs / "stragglers").glob("*-seed*"))
         if (f / "summary.json").exists()]
print(f"| stragglers, every run: overrun steps | {sum(v['overrun_steps'] for v in every)} of "
      f"{sum(v['counted_steps'] for v in every)}; worst run {max(v['overrun_fraction'] for v in every):.1%}; "
      f"D {min(v['dilation'] for v in every):g}-{max(v['dilation'] for v in every):g} | < 5% |")
