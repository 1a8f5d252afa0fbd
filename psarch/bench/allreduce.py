"""All-reduce benchmark: the ring communicator against torch.distributed's, side by side in one run.

    psarch bench allreduce [--world-size 2] [--iters 50] [--min-kib 4] [--max-mib 64] [--repeat 1]

Ranks are local processes over gloo. Per size the kinds alternate iteration by iteration, so all see the
same machine load; the time is rank 0's median after warm-up, each iteration starting after a barrier.
`cpu` is the process CPU time (all threads, gloo's included) per all-reduce, median per rank, summed over
ranks: where ranks share too few cores, CPU is what bounds the time, and it scatters less than wall time.
With --repeat R the whole run is repeated R times (fresh ranks each) and the medians over runs are shown.

Beside them, `p2p`: the ring's traffic without its arithmetic, straight on gloo's point-to-point path
(2(N-1) rounds of isend to the next rank and irecv from the previous, S/N bytes each). Its time is a lower
bound on any ring over that path: ring time >= 2(N-1)/N * S / (p2p busbw). p2p/native >= 1 says that path
alone is slower than gloo's own all-reduce, so no ring over it can match gloo there.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from collective.comm import posted
from collective.communicators import make_communicator
from psarch.launch.spawn import run_ranks

DEFAULT_SIZES = tuple(4 ** k * 1024 for k in range(1, 9))  # 4 KiB ... 64 MiB
RATIOS = (("ring", "native"), ("ring", "p2p"), ("p2p", "native"))  # time ratios, when both kinds ran


def _p2p_schedule(t: torch.Tensor, recv: torch.Tensor, rank: int, n: int) -> None:
    """The ring all-reduce's sends and receives with no reduction: 2(N-1) rounds of one S/N chunk each way."""
    chunk = t[:recv.numel()]
    for _ in range(2 * (n - 1)):
        reqs = [posted(dist.isend(chunk, (rank + 1) % n)), posted(dist.irecv(recv, (rank - 1) % n))]
        for r in reqs:
            r.wait()


def _rank(rank: int, world_size: int, sizes: Sequence[int], iters: int, kinds: Sequence[str],
          ring_options: dict[str, int]) -> list[dict] | None:
    """One rank of the benchmark (psarch.launch.spawn.run_ranks: gloo joined, one thread); rank 0 returns
    its medians per size."""
    comms = {k: make_communicator(k, None, **(ring_options if k == "ring" else {})) for k in kinds if k != "p2p"}
    rows = []
    for size in sizes:
        t = torch.randn(size // 4)  # fp32
        # Big sizes take long enough that fewer iterations give a steady median within the time budget.
        n_iter = max(5, min(iters, (512 << 20) // size))
        times: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        recv = torch.empty(t.numel() // world_size)
        ops = {k: (comms[k].all_reduce if k != "p2p" else lambda x: _p2p_schedule(x, recv, rank, world_size))
               for k in kinds}
        for i in range(n_iter + 2):  # the first two are warm-up
            for kind, op in ops.items():
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                op(t)
                if i >= 2:
                    times[kind].append(time.perf_counter() - t0)
                    cpu[kind].append(time.process_time() - c0)
                t.div_(world_size)  # keep values bounded across iterations
        cpu_sum = torch.tensor([statistics.median(cpu[k]) for k in kinds], dtype=torch.float64)
        dist.all_reduce(cpu_sum)  # CPU of all ranks: on shared cores that is what the time is made of
        rows.append({"bytes": size, "iters": n_iter, **{k: statistics.median(v) for k, v in times.items()},
                     **{f"{k} cpu": float(c) for k, c in zip(kinds, cpu_sum)}})
    for comm in comms.values():
        comm.close()
    return rows if rank == 0 else None


def bench_allreduce(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 50,
                    kinds: Sequence[str] = ("ring", "native"), **ring_options: int) -> list[dict]:
    """Median all-reduce time per size and kind; rows with algbw, busbw (bytes/s), CPU time and time ratios.

    ring_options (segment_bytes, window) go to the ring communicator; left out, its defaults hold."""
    raw = run_ranks(_rank, world_size, tuple(sizes), iters, tuple(kinds), ring_options, timeout=600)[0]
    return measured_rows(raw, world_size, kinds)


def measured_rows(raw: list[dict], world_size: int, kinds: Sequence[str]) -> list[dict]:
    """Rank 0's medians per size ({"bytes", "iters", kind: seconds, "<kind> cpu": seconds}) as table rows."""
    rows = []
    for r in raw:
        row: dict[str, Any] = {"bytes": r["bytes"], "iters": r["iters"], "world_size": world_size}
        for k in kinds:
            algbw = r["bytes"] / r[k]
            row[k] = {"time_s": r[k], "algbw": algbw, "busbw": algbw * 2 * (world_size - 1) / world_size,
                      "cpu_s": r[f"{k} cpu"]}
        for a, b in RATIOS:
            if a in kinds and b in kinds:
                row[f"{a}/{b}"] = r[a] / r[b]  # time ratio: above 1 means `a` is slower
        if "ring" in kinds and "native" in kinds:
            row["cpu ring/native"] = r["ring cpu"] / r["native cpu"]
        rows.append(row)
    return rows


def _ratio_names(row: dict) -> list[str]:
    return [name for name in [f"{a}/{b}" for a, b in RATIOS] + ["cpu ring/native"] if name in row]


def median_rows(runs: list[list[dict]], kinds: Sequence[str] = ("ring", "native")) -> list[dict]:
    """Rows of several runs folded into one: per size, the median time of each kind and the median ratio."""
    rows = []
    for same in zip(*runs):
        row = dict(same[0])
        for k in kinds:
            t = statistics.median(r[k]["time_s"] for r in same)
            row[k] = {"time_s": t, "algbw": row["bytes"] / t,
                      "busbw": row["bytes"] / t * 2 * (row["world_size"] - 1) / row["world_size"],
                      "cpu_s": statistics.median(r[k]["cpu_s"] for r in same)}
        for ratio in _ratio_names(row):  # the median of the per-run ratios: each run's pair saw the same load
            row[ratio] = statistics.median(r[ratio] for r in same)
        rows.append(row)
    return rows


def format_table(rows: list[dict], kinds: Sequence[str] = ("ring", "native")) -> str:
    """The rows as a fixed-width table (times in ms, bus bandwidth in GB/s, CPU summed over ranks in ms)."""
    head = f"{'size':>9} {'iters':>5}" + "".join(f" {k + ' ms':>10} {k + ' busbw':>12} {k + ' cpu':>10}"
                                                  for k in kinds)
    ratios = _ratio_names(rows[0]) if rows else []
    head += "".join(f" {r:>15}" for r in ratios)
    lines = [head]
    for row in rows:
        b = row["bytes"]
        size = f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
        line = f"{size:>9} {row['iters']:>5}"
        for k in kinds:
            m = row[k]
            line += f" {m['time_s'] * 1e3:>10.3f} {m['busbw'] / 1e9:>12.3f} {m['cpu_s'] * 1e3:>10.1f}"
        line += "".join(f" {row[r]:>15.2f}" for r in ratios)
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: run the benchmark and print its table."""
    ap = argparse.ArgumentParser(prog="psarch bench allreduce", description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--min-kib", type=int, default=4, help="smallest size, KiB (sizes grow by 4x from 4 KiB)")
    ap.add_argument("--max-mib", type=int, default=64, help="largest size, MiB")
    ap.add_argument("--segment-kib", type=int, default=None, help="ring pipeline segment size, KiB "
                    "(default: the ring communicator's)")
    ap.add_argument("--window", type=int, default=None, help="ring segments in flight (default: the ring's)")
    ap.add_argument("--repeat", type=int, default=1, help="runs to take the median over (the machine is noisy)")
    ap.add_argument("--no-p2p", action="store_true", help="leave out the raw isend/irecv schedule")
    args = ap.parse_args(argv)
    for name, value in (("--world-size", args.world_size), ("--iters", args.iters), ("--repeat", args.repeat),
                        ("--min-kib", args.min_kib), ("--max-mib", args.max_mib), ("--segment-kib", args.segment_kib),
                        ("--window", args.window)):
        if value is not None and value < (2 if name == "--world-size" else 1):
            ap.error(f"{name} must be at least {2 if name == '--world-size' else 1}, got {value}")
    kinds = ("ring", "native") if args.no_p2p else ("ring", "native", "p2p")
    sizes = [s for s in DEFAULT_SIZES if args.min_kib << 10 <= s <= args.max_mib << 20]
    if not sizes:
        ap.error(f"no size in {args.min_kib} KiB .. {args.max_mib} MiB; sizes are 4 KiB * 4^k up to 64 MiB")
    ring_options = {k: v for k, v in (("segment_bytes", None if args.segment_kib is None else args.segment_kib << 10),
                                      ("window", args.window)) if v is not None}
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    runs = [bench_allreduce(args.world_size, sizes, args.iters, kinds, **ring_options)
            for _ in range(args.repeat)]
    rows = median_rows(runs, kinds)
    ring = ", ".join(f"{k} {v}" for k, v in ring_options.items()) or "defaults"
    print(f"all_reduce, fp32, world size {args.world_size}, gloo on this machine ({os.cpu_count()} cores; "
          f"ring {ring}; median of rank 0{f', then median of {args.repeat} runs' if args.repeat > 1 else ''}; busbw = "
          f"bytes/time*2(N-1)/N in GB/s; cpu = CPU ms summed over ranks; ratios are times unless named cpu)")
    print(format_table(rows, kinds))
    print(f"({time.perf_counter() - t0:.0f} s; 1-minute load average {load0:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end)")

