"""The step each point of an emulated sweep is predicted to take by the step simulator (psarch.theory.simulated_step,
what `psarch report cluster | crossover` now print) against the α-β model that predicted it before
(psarch.theory.cluster_step_time with the backend's CommModel), from the same inputs: the point's config, its
model's Φ, a compute per step and α. The compute is a virtual device's modelled one (no blocking pass inside it),
or with --measured a measured one: the step less its timed wait, which holds the passes that block inside forward
and backward where the trainer times none apart (BackendSpec.compute_holds_waits); the old model then left those
passes out (CommModel.hidden_passes: ZeRO-3, torch_fsdp; torch_tensor every pass), the simulator takes the compute
apart from them (psarch.theory.pure_compute). Prints one row per point and the largest difference.

    python experiments/cluster_crossover/old_vs_simulated.py experiments/cluster_crossover/cluster_crossover.toml \
        [COMPUTE_S [ALPHA_S]] [--measured]
"""
from __future__ import annotations

import dataclasses
import sys

from psarch import registry
from psarch.config import load_config
from psarch.launch.sweep import expand, point_overrides, read_sweep
from psarch.theory import cluster_step_time, predict, pure_compute, simulated_step
from psarch.workload import build_workload

# the old model's passes inside a measured compute where the spec no longer says (its CommModel is gone): every one
OLD_HIDDEN_ALL = ("torch_tensor",)
# the trainers that time no wait apart (StepStats.comm_s 0): their measured compute is the whole step
TIME_NO_WAIT = ("torch_fsdp", "torch_tensor")


def old_step(cfg, phi: float, compute_s: float, alpha_s: float, measured: bool) -> float:
    """psarch.theory.cluster_step as it was before every backend wrote a program for the simulator."""
    spec, c = registry.spec_of(cfg), cfg.cluster
    m = spec.comm_model(cfg, phi, {})
    if cfg.backend.kind in OLD_HIDDEN_ALL:
        m = dataclasses.replace(m, hidden_passes=int(predict(cfg, phi).rounds))
    if not measured:
        m = dataclasses.replace(m, hidden_passes=0)
    # the programs written before this comparison: dense, uncompressed, the PS in sync mode with its own servers
    b = cfg.backend
    written = (b.kind not in ("torch_fsdp", "torch_pipeline", "torch_tensor", "dp", "torch_dp")
               and cfg.train.compression == "none" and b.embeddings == "dense"
               and (b.kind != "ps" or (b.mode == "sync" and not b.server_addresses)))
    if written and not m.hidden_passes:
        step = simulated_step(cfg, phi, compute_s, None, alpha_s)
        if step is not None:
            return step.step_s
    return cluster_step_time(predict(cfg, phi), compute_s, c.link_mbps, c.server_mbps, alpha_s, m)["step_time_s"]


def main(path: str, compute_s: float = 0.05, alpha_s: float = 1e-4, measured: bool = False) -> None:
    sweep = read_sweep(path)
    assert sweep is not None, f"{path}: no [sweep]"
    phis: dict[str, int] = {}
    worst = 0.0
    print(f"| point | old α-β | simulated | difference |   (compute {compute_s * 1e3:g} ms "
          f"{'measured' if measured else 'modelled'}, α {alpha_s * 1e6:g} us)")
    for point in expand(path, sweep):
        cfg = load_config(path, point_overrides(None, point.overrides))
        key = repr(cfg.workload)
        if key not in phis:
            phis[key] = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters())
        phi = phis[key]
        old = old_step(cfg, phi, compute_s, alpha_s, measured)
        spec = registry.spec_of(cfg)
        compute = (pure_compute(cfg, phi, compute_s, alpha_s, cfg.backend.kind in TIME_NO_WAIT)
                   if measured and spec.compute_holds_waits(cfg) else compute_s)
        new = simulated_step(cfg, phi, compute, None, alpha_s)
        if new is None:
            print(f"| {point.name} | {old * 1e3:.1f} ms | (no program: the old model stays) | |")
            continue
        diff = new.step_s / old - 1
        worst = max(worst, abs(diff))
        print(f"| {point.name} | {old * 1e3:.1f} ms | {new.step_s * 1e3:.1f} ms | {diff:+.1%} |")
    print(f"largest difference {worst:.1%}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--measured"]
    main(args[0], *map(float, args[1:]), measured="--measured" in sys.argv)
