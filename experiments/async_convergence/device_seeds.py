"""README's table of the device study: every mode over its seeds, mean ± 95% CI (psarch.report.seeds) of compare's own
figures (final gap, steps and time to the target gap, the config's convergence_target x the initial gap,
samples/s; psarch.report.compare.convergence_of), the time to the target with every worker's losses at its own clock
(psarch.report.stragglers), how many diverged, and each group's D and overrun steps (the worst run, and
how many runs overran more than 5% of their steps), then every run's. The argument: the sweep's run folder (the
one holding sweep.json):
    python experiments/async_convergence/device_seeds.py runs/async_convergence_device > \
        experiments/async_convergence/results/device/seeds.md"""
import json
import sys
from pathlib import Path

from psarch.cluster.device import OVERRUN_WARN
from psarch.report.stragglers import time_to_gap
from psarch.report.compare import convergence_of
from psarch.report.curves import diverged
from psarch.report.runs import load_run, target_gaps
from psarch.report.seeds import interval, seed_groups
from psarch.throughput import per_worker


def ci(xs: list, form: str) -> str:
    i = interval(xs)
    if i is None:
        return "-"
    return f"{i.mean:{form}} (n = 1)" if i.n == 1 else f"{i.mean:{form}} ± {i.half:{form}} (n = {i.n})"


sweep = Path(sys.argv[1])
order = [p["name"] for p in json.loads((sweep / "sweep.json").read_text())]   # the sweep's own order
runs = [load_run(sweep / n) for n in order if (sweep / n / "summary.json").exists()]
targets = dict(zip(map(id, runs), target_gaps(runs)))
print(f"| mode (N = 4) | seeds | gap, mean of last 20 steps | steps to the target gap "
      f"({', '.join(sorted({f'{t:.2f}' for t in targets.values()}))}) | time to it (s) | time to it, own clocks (s) | "
      f"samples/s | diverged | not reached | D | overrun steps, worst run | runs over {OVERRUN_WARN:.0%} |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for group in seed_groups(runs):
    cs = [convergence_of(r, targets[id(r)]) for r in group]
    vds = [r["summary"]["virtual_device"] for r in group]
    own = [time_to_gap(per_worker(r["metrics"]), r["summary"]["entropy_floor"], targets[id(r)]) for r in group]
    name = group[0]["summary"]["name"].split("/")[-1].rsplit("-seed", 1)[0]
    print(f"| {name} | {', '.join(str(r['config']['seed']) for r in group)} | {ci([c.gap for c in cs], '.4f')} | "
          f"{ci([c.steps for c in cs], '.1f')} | {ci([c.seconds for c in cs], '.2f')} | {ci(own, '.2f')} | "
          f"{ci([r['summary']['samples_per_s'] for r in group], '.0f')} | "
          f"{sum(diverged([m['loss'] for m in r['metrics']]) for r in group)} | {sum(c.steps is None for c in cs)} | "
          f"{min(v['dilation'] for v in vds):g}-{max(v['dilation'] for v in vds):g} | "
          f"{max(v['overrun_fraction'] for v in vds):.1%} | {sum(v['overrun_fraction'] > OVERRUN_WARN for v in vds)} |")
print()
print("| run | D | overrun steps |\n|---|---:|---:|")
for r in runs:
    v = r["summary"]["virtual_device"]
    flag = f" **over {OVERRUN_WARN:.0%}**" if v["overrun_fraction"] > OVERRUN_WARN else ""
    print(f"| {r['summary']['name'].split('/')[-1]} | {v['dilation']:g} | {v['overrun_steps']} of "
          f"{v['counted_steps']} ({v['overrun_fraction']:.1%}){flag} |")
