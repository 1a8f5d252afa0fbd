"""The step each point of an emulated sweep is predicted to take by the step simulator (psarch.theory.simulated_step,
what `psarch report cluster | crossover` now print) against the α-β model that predicted it before
(psarch.theory.cluster_step_time with the backend's CommModel), from the same inputs: the point's config, its
model's Φ, a compute per step and α (as a virtual device's modelled compute, which holds no blocking pass: with a
measured compute ZeRO-3's passes are inside it and the old model stays). Prints one row per point and the largest
difference.

    python experiments/cluster_crossover/old_vs_simulated.py experiments/cluster_crossover/cluster_crossover.toml \
        [COMPUTE_S [ALPHA_S]]
"""
from __future__ import annotations

import dataclasses
import sys

from psarch import registry
from psarch.config import load_config
from psarch.launch.sweep import expand, point_overrides, read_sweep
from psarch.theory import cluster_step_time, predict, simulated_step
from psarch.workload import build_workload


def main(path: str, compute_s: float = 0.05, alpha_s: float = 1e-4) -> None:
    sweep = read_sweep(path)
    assert sweep is not None, f"{path}: no [sweep]"
    phis: dict[str, int] = {}
    worst = 0.0
    print(f"| point | old α-β | simulated | difference |   (compute {compute_s * 1e3:g} ms, α {alpha_s * 1e6:g} us)")
    for point in expand(path, sweep):
        cfg = load_config(path, point_overrides(None, point.overrides))
        key = repr(cfg.workload)
        if key not in phis:
            phis[key] = sum(p.numel() for p in build_workload(cfg).model.parameters())
        phi = phis[key]
        m = dataclasses.replace(registry.spec_of(cfg).comm_model(cfg, phi, {}), hidden_passes=0)
        c = cfg.cluster
        old = cluster_step_time(predict(cfg, phi), compute_s, c.link_mbps, c.server_mbps, alpha_s, m)["step_time_s"]
        new = simulated_step(cfg, phi, compute_s, None, alpha_s)
        if new is None:
            print(f"| {point.name} | {old * 1e3:.1f} ms | (no program: the old model stays) | |")
            continue
        diff = new.step_s / old - 1
        worst = max(worst, abs(diff))
        print(f"| {point.name} | {old * 1e3:.1f} ms | {new.step_s * 1e3:.1f} ms | {diff:+.1%} |")
    print(f"largest difference {worst:.1%}")


if __name__ == "__main__":
    main(sys.argv[1], *map(float, sys.argv[2:]))
