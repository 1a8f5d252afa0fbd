"""The pipeline benchmark, in one run: psarch's pipeline against torch.distributed.pipelining on the same
model, data, stages and micro-batches, for each schedule both have.

    psarch bench pipeline [--stages 2] [--microbatches 4] [--steps 20]

Both trainers are built side by side in the same ranks and stepped in turn (psarch.bench.shared.interleaved), so
they see the same machine load; step time is the slowest rank's median after warm-up. Goal: ratio <= 1.05.
Also printed: each rank's measured idle fraction of its pipeline phase beside the bubble formula (on shared
CPU cores the stages do not compute at a fixed speed, so the two need not agree here).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from collective.pipeline.schedule import bubble_fraction
from collective.pipeline.theory import pipe_of
from psarch.bench.shared import interleaved, trainer_loop
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.throughput import warmup_steps
from psarch.launch.spawn import run_ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def bench_config(p: int, m: int, steps: int, schedule: str, kind: str) -> dict:
    """A GPT of ~3.3M parameters (the collective benchmark's), 2 blocks per stage (interleaved: 1 per chunk)."""
    return {"seed": 0, "workload": {"model": "gpt", "seq_len": 64, "markov": {"vocab_size": 256},
                                    "gpt": {"n_layer": 2 * p, "n_embd": 256, "n_head": 4}},
            "train": {"steps": steps, "global_batch": 4 * m, "optimizer": "adamw", "lr": 1e-3},
            "backend": {"kind": kind, "world_size": p, "stages": p, "microbatches": m, "schedule": schedule,
                        **({"virtual_stages": 2} if schedule == "interleaved" else {})}}


def _rank(rank: int, world_size: int, m: int, steps: int) -> dict:
    ctx = DistContext(rank, world_size, rank, torch.device("cpu"), "gloo")
    configs = {(s, kind): from_dict(bench_config(world_size, m, steps, s, kind))
               for s in SCHEDULES for kind in ("pipeline", "torch_pipeline")}
    loops = {f"{s} {kind}": trainer_loop(cfg, ctx) for (s, kind), cfg in configs.items()}
    times = interleaved({label: loop.timed for label, loop in loops.items()}, steps,
                        warmup_steps(next(iter(configs.values()))))
    out = {}
    for label, loop in loops.items():
        idle = getattr(loop.trainer, "idle", [])
        out[label] = {"step_s": statistics.median(times[label]),
                      "idle": statistics.median(idle[warmup_steps(next(iter(configs.values()))):]) if idle else None}
        loop.trainer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="psarch bench pipeline", description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    results = run_ranks(_rank, a.stages, a.microbatches, a.steps, timeout=1800)
    print(f"p = {a.stages}, m = {a.microbatches}, {a.steps} steps, gloo on CPU "
          f"({torch.get_num_threads()} threads here, 1 per rank)")
    print(f"{'schedule':<12} {'pipeline ms':>12} {'torch ms':>10} {'ratio':>6}  idle per stage measured | predicted")
    for s in SCHEDULES:
        mine = max(r[f"{s} pipeline"]["step_s"] for r in results)
        peer = max(r[f"{s} torch_pipeline"]["step_s"] for r in results)
        cfg = from_dict(bench_config(a.stages, a.microbatches, a.steps, s, "pipeline"))
        pred = float(bubble_fraction(s, pipe_of(cfg)))
        idle = " ".join(f"{r[f'{s} pipeline']['idle']:.2f}" for r in results)
        print(f"{s:<12} {mine * 1e3:>12.2f} {peer * 1e3:>10.2f} {mine / peer:>6.3f}  {idle} | {pred:.2f}")

