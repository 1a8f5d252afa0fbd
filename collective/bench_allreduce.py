"""All-reduce benchmark: the ring communicator against torch.distributed's, side by side in one run.

    python -m collective.bench_allreduce [--world-size 2] [--iters 50] [--max-mib 64] [--segment-kib 1024] [--repeat 1]

Ranks are local processes over gloo. Per size the kinds alternate iteration by iteration, so both see the
same machine load; the time is rank 0's median after warm-up, each iteration starting after a barrier.
With --repeat R the whole run is repeated R times (fresh ranks each) and the medians over runs are shown.

Beside them, `p2p`: the ring's traffic without its arithmetic, straight on gloo's point-to-point path
(2(N-1) rounds of isend to the next rank and irecv from the previous, S/N bytes each). Its busbw is the
most a ring over gloo's send/recv can reach; ring/p2p near 1 means that path, not the ring, is the bound.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from collective import make_communicator

DEFAULT_SIZES = tuple(4 ** k * 1024 for k in range(1, 9))  # 4 KiB ... 64 MiB


def _p2p_schedule(t: torch.Tensor, recv: torch.Tensor, rank: int, n: int) -> None:
    """The ring all-reduce's sends and receives with no reduction: 2(N-1) rounds of one S/N chunk each way."""
    chunk = t[:recv.numel()]
    for _ in range(2 * (n - 1)):
        reqs = [dist.isend(chunk, (rank + 1) % n), dist.irecv(recv, (rank - 1) % n)]
        for r in reqs:
            r.wait()


def _rank(rank: int, world_size: int, port: int, sizes: Sequence[int], iters: int, kinds: Sequence[str],
          segment_bytes: int, results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        comms = {k: make_communicator(k, **({"segment_bytes": segment_bytes} if k == "ring" else {}))
                 for k in kinds if k != "p2p"}
        rows = []
        for size in sizes:
            t = torch.randn(size // 4)  # fp32
            # Big sizes take long enough that fewer iterations give a steady median within the time budget.
            n_iter = max(5, min(iters, (512 << 20) // size))
            times: dict[str, list[float]] = {k: [] for k in kinds}
            recv = torch.empty(t.numel() // world_size)
            ops = {k: (comms[k].all_reduce if k != "p2p" else lambda x: _p2p_schedule(x, recv, rank, world_size))
                   for k in kinds}
            for i in range(n_iter + 2):  # the first two are warm-up
                for kind, op in ops.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    op(t)
                    if i >= 2:
                        times[kind].append(time.perf_counter() - t0)
                    t.div_(world_size)  # keep values bounded across iterations
            rows.append({"bytes": size, "iters": n_iter, **{k: statistics.median(v) for k, v in times.items()}})
        for comm in comms.values():
            comm.close()
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def bench_allreduce(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 50,
                    kinds: Sequence[str] = ("ring", "native"), segment_bytes: int = 1 << 20) -> list[dict]:
    """Median all-reduce time per size and communicator kind; rows with algbw, busbw (bytes/s), ring/native."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world_size, store.port, tuple(sizes), iters, tuple(kinds),
                                             segment_bytes, results), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        raw = results.get(timeout=600)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    rows = []
    for r in raw:
        row: dict[str, Any] = {"bytes": r["bytes"], "iters": r["iters"], "world_size": world_size}
        for k in kinds:
            algbw = r["bytes"] / r[k]
            row[k] = {"time_s": r[k], "algbw": algbw, "busbw": algbw * 2 * (world_size - 1) / world_size}
        for other in ("native", "p2p"):
            if "ring" in kinds and other in kinds:
                row[f"ring/{other}"] = r["ring"] / r[other]  # time ratio: above 1 means the ring is slower
        rows.append(row)
    return rows


def median_rows(runs: list[list[dict]], kinds: Sequence[str] = ("ring", "native")) -> list[dict]:
    """Rows of several runs folded into one: per size, the median time of each kind and the median ratio."""
    rows = []
    for same in zip(*runs):
        row = dict(same[0])
        for k in kinds:
            t = statistics.median(r[k]["time_s"] for r in same)
            row[k] = {"time_s": t, "algbw": row["bytes"] / t,
                      "busbw": row["bytes"] / t * 2 * (row["world_size"] - 1) / row["world_size"]}
        for ratio in ("ring/native", "ring/p2p"):
            if ratio in row:
                row[ratio] = statistics.median(r[ratio] for r in same)
        rows.append(row)
    return rows


def format_table(rows: list[dict], kinds: Sequence[str] = ("ring", "native")) -> str:
    """The rows as a fixed-width table (times in ms, bandwidths in GB/s)."""
    head = f"{'size':>9} {'iters':>5}" + "".join(f" {k + ' ms':>10} {k + ' algbw':>12} {k + ' busbw':>12}"
                                                  for k in kinds)
    ratios = [r for r in ("ring/native", "ring/p2p") if rows and r in rows[0]]
    head += "".join(f" {r:>11}" for r in ratios)
    lines = [head]
    for row in rows:
        b = row["bytes"]
        size = f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
        line = f"{size:>9} {row['iters']:>5}"
        for k in kinds:
            m = row[k]
            line += f" {m['time_s'] * 1e3:>10.3f} {m['algbw'] / 1e9:>12.3f} {m['busbw'] / 1e9:>12.3f}"
        line += "".join(f" {row[r]:>11.2f}" for r in ratios)
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: run the benchmark and print its table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--max-mib", type=int, default=64, help="largest size, MiB (sizes grow by 4x from 4 KiB)")
    ap.add_argument("--segment-kib", type=int, default=1024, help="ring pipeline segment size, KiB")
    ap.add_argument("--repeat", type=int, default=1, help="runs to take the median over (the machine is noisy)")
    ap.add_argument("--no-p2p", action="store_true", help="leave out the raw isend/irecv schedule")
    args = ap.parse_args(argv)
    kinds = ("ring", "native") if args.no_p2p else ("ring", "native", "p2p")
    sizes = [s for s in DEFAULT_SIZES if s <= args.max_mib << 20]
    t0 = time.perf_counter()
    runs = [bench_allreduce(args.world_size, sizes, args.iters, kinds, segment_bytes=args.segment_kib << 10)
            for _ in range(args.repeat)]
    rows = median_rows(runs, kinds)
    print(f"all_reduce, fp32, world size {args.world_size}, gloo on this machine (median of rank 0"
          f"{f', then median of {args.repeat} runs' if args.repeat > 1 else ''}; algbw = bytes/time, "
          f"busbw = algbw*2(N-1)/N; bandwidths in GB/s)")
    print(format_table(rows, kinds))
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
