"""The tensor-parallel benchmark, in one run: psarch's `tensor` (ring and native) against PyTorch's own tensor
parallelism (`torch_tensor`) on the same GPT, data and ranks.

    psarch bench tensor [--world-size 2] [--tensor-parallel 0] [--steps 20]

The trainers are built side by side in the same ranks and stepped in turn (psarch.bench.shared), so they see the same
machine load; step time is the slowest rank's median after warm-up. Goal: step time ratio <= 1.05 against
torch_tensor. Beside it each variant's bytes per step (ring: counted; native and torch: modelled) and
model-state bytes, each with theory's figure.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence

import torch

from collective.tensor.theory import held_params
from psarch import theory
from psarch.bench.shared import interleaved, trainer_loop
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.throughput import warmup_steps
from psarch.launch.spawn import run_ranks

PEER = "torch_tensor"
VARIANTS = {"tensor ring": {"kind": "tensor", "comm": "ring"}, "tensor native": {"kind": "tensor", "comm": "native"},
            PEER: {"kind": "torch_tensor"}}


def bench_config(world_size: int, tp: int, steps: int, backend: dict) -> dict:
    """A GPT of ~3.3M parameters (the collective and ZeRO benchmarks'), 8 sequences per data-parallel replica."""
    dp = world_size // (tp or world_size)
    return {"seed": 0, "workload": {"model": "gpt", "seq_len": 64, "gpt": {"n_layer": 4, "n_embd": 256, "n_head": 4},
                                    "markov": {"vocab_size": 256}},
            "train": {"steps": steps, "global_batch": 8 * dp, "optimizer": "adamw", "lr": 1e-3},
            "backend": {"world_size": world_size, "tensor_parallel": tp, **backend}}


def _rank(rank: int, world_size: int, tp: int, steps: int) -> dict:
    ctx = DistContext(rank, world_size, rank, torch.device("cpu"), "gloo")
    configs = {label: from_dict(bench_config(world_size, tp, steps, b)) for label, b in VARIANTS.items()}
    loops = {label: trainer_loop(cfg, ctx) for label, cfg in configs.items()}
    before = {label: loop.trainer.traffic().sent for label, loop in loops.items()}
    times = interleaved({label: loop.timed for label, loop in loops.items()}, steps,
                        warmup_steps(next(iter(configs.values()))))
    out = {}
    for label, loop in loops.items():
        m, tr = loop.trainer.memory(), loop.trainer.traffic()
        p = theory.predict(configs[label], held_params(configs[label])[1])   # Φ: the whole model's
        out[label] = {"step_s": statistics.median(times[label]), "model_state": m.total,
                      "sent": (tr.sent - before[label]) / steps, "modelled": tr.modelled,
                      "predicted_sent": p.link.sent, "predicted_state": p.memory_per_rank.total}
        loop.trainer.close()
    return out


def format_table(results: list[dict]) -> str:
    rows = {label: dict(results[0][label], step_s=max(r[label]["step_s"] for r in results)) for label in VARIANTS}
    peer = rows[PEER]["step_s"]
    head = (f"{'variant':14} {'step ms':>8} {'vs torch':>8}   {'sent/step KiB':>13} {'theory':>8}   "
            f"{'state KiB':>9} {'theory':>8}")
    lines = [head, "-" * len(head)]
    for label, x in rows.items():
        lines.append(f"{label:14} {x['step_s'] * 1e3:8.1f} {x['step_s'] / peer:8.2f}   "
                     f"{x['sent'] / 1024:12.1f}{'*' if x['modelled'] else ' '} {x['predicted_sent'] / 1024:8.1f}   "
                     f"{x['model_state'] / 1024:9.1f} {x['predicted_state'] / 1024:8.1f}")
    lines.append("* modelled: torch.distributed's wire cannot be seen; the algorithm's volume is shown")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="psarch bench tensor", description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--tensor-parallel", type=int, default=0, help="t (0: the whole world)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = run_ranks(_rank, args.world_size, args.tensor_parallel, args.steps, timeout=900)
    tp = args.tensor_parallel or args.world_size
    print(f"== tensor parallelism vs PyTorch's, GPT 4 x 256, seq 64, t={tp} x dp={args.world_size // tp}, fp32 "
          f"AdamW, gloo on CPU, median of {args.steps - warmup_steps(from_dict(bench_config(2, 0, args.steps, VARIANTS[PEER])))} "
          f"steps, trainers interleaved (slowest rank)")
    print("goal: step time ratio <= 1.05 against torch_tensor")
    print(format_table(results))
    print(f"({time.perf_counter() - t0:.0f} s)")

