"""The collective benchmark, in one run: ring vs native all-reduce bus bandwidth (4 KiB to 64 MiB), then
psarch DDP (ring, native) vs torch DDP step time on the same model, data and world size.

    psarch bench ddp [--world-size 2] [--steps 30] [--max-mib 64]

The DDP trainers are built side by side in the same ranks and stepped in turn (ring, native, torch,
ring, ...), so all three see the same machine load; each figure is rank 0's median step time.
"""
from __future__ import annotations

import argparse
import time
from typing import Sequence

import torch

from psarch.bench.allreduce import DEFAULT_SIZES, bench_allreduce, format_table
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.bench.shared import interleaved, medians, trainer_loop
from psarch.throughput import warmup_steps
from psarch.launch.spawn import run_ranks

PEERS = {"psarch ddp (ring)": ("ddp", "ring"), "psarch ddp (native)": ("ddp", "native"), "torch ddp": ("torch_ddp", "")}


def ddp_config(world_size: int, steps: int) -> dict:
    """A GPT of ~3.2M parameters: big enough that gradient all-reduce is a real share of a CPU step."""
    return {"seed": 0, "workload": {"model": "gpt", "seq_len": 64, "gpt": {"n_layer": 4, "n_embd": 256, "n_head": 4},
                                    "markov": {"vocab_size": 256}},
            "train": {"steps": steps, "global_batch": 8 * world_size, "optimizer": "adamw", "lr": 1e-3},
            "backend": {"world_size": world_size, "bucket_cap_mb": 25}}


def _ddp_rank(rank: int, world_size: int, steps: int) -> dict:
    base = ddp_config(world_size, steps)
    ctx = DistContext(rank, world_size, rank, torch.device("cpu"), "gloo")
    cfgs = {label: from_dict(dict(base, backend=dict(base["backend"], kind=kind, **({"comm": comm} if comm else {}))))
            for label, (kind, comm) in PEERS.items()}
    loops = {label: trainer_loop(cfg, ctx) for label, cfg in cfgs.items()}
    # the warm-up of a ddp config (base alone is backend.kind = "single", which refuses world_size > 1)
    times = interleaved({label: loop.timed for label, loop in loops.items()}, steps,
                        warmup_steps(cfgs["torch ddp"]))
    params = sum(p.numel() for p in loops["torch ddp"].workload.model.parameters())
    for loop in loops.values():
        loop.trainer.close()
    return {"params": params, **medians(times)}


def bench_ddp(world_size: int = 2, steps: int = 30) -> dict:
    return run_ranks(_ddp_rank, world_size, steps, timeout=900)[0]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="psarch bench ddp", description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--iters", type=int, default=50, help="all-reduce iterations per size")
    ap.add_argument("--max-mib", type=int, default=64)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = bench_allreduce(args.world_size, [s for s in DEFAULT_SIZES if s <= args.max_mib << 20], args.iters)
    print(f"== all_reduce, fp32, N={args.world_size}, gloo (median of rank 0; GB/s; busbw = algbw*2(N-1)/N)")
    print(format_table(rows))
    big = rows[-1]
    print(f"ring busbw / native busbw at {big['bytes'] >> 20} MiB: "
          f"{big['ring']['busbw'] / big['native']['busbw']:.2f}  (target >= 0.9)\n")
    r = bench_ddp(args.world_size, args.steps)
    print(f"== DDP step time, GPT {r['params']:,} params, N={args.world_size}, fp32 AdamW, "
          f"median of {args.steps - 3} steps, trainers interleaved")
    torch_t = r["torch ddp"]
    for label in PEERS:
        target = {"psarch ddp (ring)": "  (target <= 1.2)", "psarch ddp (native)": "  (target <= 1.05)"}.get(label, "")
        print(f"{label:22} {r[label] * 1e3:9.2f} ms   x{r[label] / torch_t:5.2f} torch ddp{target}")
    print(f"({time.perf_counter() - t0:.0f} s)")

