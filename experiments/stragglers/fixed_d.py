"""The straggler runs whose auto-dilated run overran more than 5% of its steps, run again at a fixed, larger D
(fixed_d.toml): each beside its auto run, so what the host's share of their time changed can be seen.
    python experiments/stragglers/fixed_d.py runs/stragglers runs/stragglers_fixed_d > \\
        experiments/stragglers/results/fixed_d.md"""
import sys
from pathlib import Path

from psarch.report.stragglers import final_gap, time_to_gap
from psarch.report.runs import load_run, target_gaps
from psarch.throughput import per_worker


def figures(run: dict, target: float) -> list[str]:
    """D, overrun steps, samples/s, time to the target gap (own clocks) and final gap of one run."""
    s, workers = run["summary"], per_worker(run["metrics"])
    v, t = s["virtual_device"], time_to_gap(workers, s["entropy_floor"], target)
    return [f"{v['dilation']:g}", f"{v['overrun_steps']} of {v['counted_steps']} ({v['overrun_fraction']:.1%})",
            f"{s['samples_per_s']:.0f}", "not reached" if t is None else f"{t:.1f}",
            f"{final_gap(workers, s['entropy_floor']):.3f}"]


auto, fixed = Path(sys.argv[1]), Path(sys.argv[2])
again = sorted(f.parent.name for f in fixed.glob("*/summary.json"))
runs = {(where, name): load_run(where / name) for where in (auto, fixed) for name in again}
every = [load_run(f.parent) for f in sorted(auto.glob("*/summary.json"))]   # the targets as stragglers.md's
targets = dict(zip((id(r) for r in every + list(runs.values())), target_gaps(every + list(runs.values()))))
print("| run | D: auto \\| fixed | overrun steps: auto \\| fixed | samples/s: auto \\| fixed | time to half the "
      "initial gap (s): auto \\| fixed | final gap: auto \\| fixed |\n|---|---|---|---|---|---|")
for name in again:
    a, b = (figures(runs[where, name], targets[id(runs[where, name])]) for where in (auto, fixed))
    print(f"| {name} | " + " | ".join(f"{x} \\| {y}" for x, y in zip(a, b)) + " |")
