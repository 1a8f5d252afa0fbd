"""Step time of ZeRO stages 1, 2 and 3 side by side: is each stage as fast as the one it refines?

    psarch bench zero-stages [--world-size 2] [--steps 30] [--runs 3] [--comm native] [--activations]

The psarch.bench.zero model (GPT, ~3.3M parameters), fp32 AdamW. Each run spawns fresh ranks that build every
variant's trainer side by side and step them in turn, so all see the same machine load; a variant's
time is the slowest rank's median over the run's steps after 3 warm-up steps. Printed: each run's
medians, the median over runs, and each variant's ratio to stage 1. `--activations` adds each stage
again with `backend.measure_activations = true`, to show what measuring saved activations costs.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Sequence

import torch

from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.bench.shared import interleaved, medians, trainer_loop
from psarch.throughput import warmup_steps
from psarch.launch.spawn import run_ranks
from psarch.bench.zero import bench_config


def variants(comm: str, activations: bool) -> dict[str, dict]:
    """label -> backend overrides: the three stages, and with `activations` each again with the meter on."""
    out = {f"zero-{s} {comm}": {"kind": "zero", "stage": s, "comm": comm} for s in (1, 2, 3)}
    if activations:
        out.update({f"{label} +act": dict(b, measure_activations=True) for label, b in list(out.items())})
    return out


def _rank(rank: int, world_size: int, steps: int, backends: dict[str, dict]) -> dict[str, float]:
    base = bench_config(world_size, steps)
    ctx = DistContext(rank, world_size, rank, torch.device("cpu"), "gloo")
    loops = {label: trainer_loop(from_dict(dict(base, backend=dict(base["backend"], **backend))), ctx)
             for label, backend in backends.items()}
    times = interleaved({label: loop.timed for label, loop in loops.items()}, steps,
                        warmup_steps(next(iter(loops.values())).cfg))   # base alone is kind "single", 1 worker
    for loop in loops.values():
        loop.trainer.close()
    return medians(times)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="psarch bench zero-stages", description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--comm", choices=("ring", "native"), default="native")
    ap.add_argument("--activations", action="store_true", help="also each stage with measure_activations = true")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.runs < 1:
        ap.error(f"--steps must be >= 2 (warm-up steps are left out: min(5, steps // 5)) and --runs >= 1, got "
                 f"{args.steps} and {args.runs}")
    backends = variants(args.comm, args.activations)
    runs = []
    for _ in range(args.runs):
        ranks = run_ranks(_rank, args.world_size, args.steps, backends, timeout=900)
        runs.append({label: max(r[label] for r in ranks) for label in backends})
    print(f"== ZeRO stages, GPT ~3.3M params, N={args.world_size}, fp32 AdamW, {args.comm}, {args.runs} runs of "
          f"{args.steps} steps, variants interleaved step by step; ms, slowest rank's median per run")
    first = next(iter(backends))
    print(f"{'variant':22} {'runs':>24} {'median':>8} {'vs ' + first:>18}")
    for label in backends:
        per_run = [r[label] * 1e3 for r in runs]
        ratios = [r[label] / r[first] for r in runs]
        print(f"{label:22} {' '.join(f'{t:7.1f}' for t in per_run):>24} {statistics.median(per_run):8.1f} "
              f"{statistics.median(ratios):18.3f}")

