"""Step time of psarch's trainers against a hand-written PyTorch loop, same model and batches, one process.

    psarch bench step [--device cpu|cuda] [--precision fp32,bf16] [--backends single,ddp,zero]
                      [--steps 40] [--warmup 5] [--n-layer 4 --n-embd 256 --seq-len 64 --batch 8]

(`python -m psarch.bench_step ...` is the same command: psarch/bench_step.py, the entry the GPU instructions name.)

Pairs, each psarch runner beside the PyTorch program a user would write for the same thing (the backend's
spec names it: BackendSpec.bench_peer):
  single     vs  plain loop: AdamW(fused=True); bf16 as autocast over fp32 weights
  ddp        vs  torch DDP (DistributedDataParallel) + the same loop
  zero (3)   vs  FSDP2 fully_shard per block, then the root (bf16: MixedPrecisionPolicy(param_dtype=bf16))
ddp and zero run at world size 1 in this process (gloo on a CPU, NCCL on a GPU): what is measured is
the framework's own overhead, not communication. Every runner takes one step in turn on the same batch
(psarch.bench.shared.interleaved: the order rotates each step), so all see the same machine load; the figures are
medians after warm-up (the runner's rule unless --warmup says), and each psarch runner's ratio is to its
peer's median. A psarch step is Trainer.step timed by the runner's StepLoop (metrics records, logging and
the rest of the runner's loop are not included); every step ends with loss.item(), psarch's and the peers'.
Beside the times: the model FLOPs a step does (forward and backward, FlopCounterMode's count; the optimizer
is not counted, as MFU is defined), the rate psarch's step reaches, and on a GPU with a profile in
psarch.cluster.device (an H100, say) its MFU: that rate over the profile's peak at the precision, the
figure a virtual device's `cluster.mfu` stands for.
"""
from __future__ import annotations

import argparse
import importlib
import time
from typing import Any, Callable, TypedDict

import torch
import torch.distributed as dist

from psarch import registry
from psarch.bench.shared import interleaved, medians, trainer_loop
from psarch.cluster import device as vdevice
from psarch.cluster.flops import count
from psarch.config import Config, from_dict
from psarch.dist import DistContext
from psarch.precision import compute_dtype
from psarch.launch.runner import to_device
from psarch.throughput import warmup_steps
from psarch.workload import Workload, build_workload


def bench_config(args: argparse.Namespace, kind: str, precision: str) -> Config:
    """~3.2M parameters at the defaults (the GPT of psarch.bench.ddp): the optimizer is a visible share."""
    backend = {"kind": kind, "world_size": 1, **registry.spec(kind).bench_options}
    return from_dict({"seed": 0, "workload": {"model": "gpt", "seq_len": args.seq_len, "markov": {"vocab_size": 256},
                                              "gpt": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": 4}},
                      "train": {"steps": args.steps, "global_batch": args.batch, "optimizer": "adamw", "lr": 1e-3,
                                "precision": precision},
                      "backend": backend})


def adamw(params: Any, cfg: Config) -> torch.optim.Optimizer:
    """What a user writes: torch's fastest AdamW, with psarch's hyper-parameters."""
    t = cfg.train
    return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay, fused=True)


def plain_step(model: torch.nn.Module, loss_fn: Callable, opt: torch.optim.Optimizer, precision: str,
               device: torch.device) -> Callable[[Any], float]:
    """The hand-written loop: forward (under autocast in bf16), backward, step, zero_grad(set_to_none)."""
    low = precision != "fp32"

    def step(batch: Any) -> float:
        with torch.autocast(device.type, dtype=compute_dtype(precision), enabled=low):
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())
    return step


def plain_peer(cfg: Config, device: torch.device) -> tuple[str, Callable[[Any], float]]:
    """The peer of `single`: the plain loop on the same initial model (fp32 weights; bf16 under autocast)."""
    w = build_workload(cfg)
    model = w.model.to(device)
    return "plain loop", plain_step(model, w.loss_fn, adamw(model.parameters(), cfg), cfg.train.precision, device)


def peer_runner(kind: str, cfg: Config, device: torch.device) -> tuple[str, Callable[[Any], float]]:
    """The PyTorch program beside psarch `kind` (its spec's bench_peer), from the same initial model."""
    peer = registry.spec(kind).bench_peer
    if peer is None:
        raise ValueError(f"backend.kind = {kind!r} names no PyTorch program beside it (BackendSpec.bench_peer)")
    module, _, name = peer.partition(":")
    return getattr(importlib.import_module(module), name)(cfg, device)


def psarch_runner(kind: str, cfg: Config, ctx: DistContext) -> Callable[[Any], float]:
    """psarch's trainer for `kind`, stepped as the runner steps it: batch -> loss."""
    loop = trainer_loop(cfg, ctx)
    return lambda batch: loop.step(to_device(batch, ctx.device, loop.cast))[0].loss


def _timed(fn: Callable[[Any], float], workload: Workload, device: torch.device, cast: torch.dtype | None
           ) -> Callable[[int], float]:
    """step -> seconds of fn on that step's batch (made outside the clock), synchronised on a GPU."""
    def run(step: int) -> float:
        batch = to_device(workload.batch(step, 0, 1), device, cast)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0
    return run


def init_group(device: torch.device) -> DistContext:
    """A world-size-1 process group in this process: gloo on a CPU, NCCL on a GPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    return DistContext(0, 1, 0, device, backend)


class StepRow(TypedDict):
    """One backend at one precision against its torch peer: step times, their ratio, throughput."""

    precision: str
    backend: str
    peer: str                    # the torch peer's name
    params: int
    psarch_ms: float
    peer_ms: float
    ratio: float                 # psarch over peer
    tflops: float
    mfu: float | None            # None without a GPU profile


def run(args: argparse.Namespace) -> list[StepRow]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here; use --device cpu")
    # NCCL's device_id needs an index
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    grouped = any(registry.spec(k).needs_process_group for k in args.backends)
    group = init_group(device) if grouped else None
    rows: list[StepRow] = []
    for precision in args.precision:
        runners: dict[str, Callable[[int], float]] = {}
        peers: dict[str, str] = {}
        for kind in args.backends:
            cfg = bench_config(args, kind, precision)
            if registry.spec(kind).needs_process_group:
                assert group is not None, "grouped: started above when some backend needs it"
                ctx = group
            else:
                ctx = DistContext(0, 1, 0, device)
            loop = trainer_loop(cfg, ctx)
            runners[f"psarch {kind}"] = loop.timed
            peers[kind], peer_step = peer_runner(kind, cfg, device)
            runners[peers[kind]] = _timed(peer_step, loop.workload, device, None)   # the peer casts (autocast) itself
        w = build_workload(bench_config(args, "single", precision))
        params = sum(p.numel() for p in w.model.parameters())
        fc = count(w.model, w.loss_fn, w.batch(0, 0, 1))
        peak = gpu_peak_tflops(device, precision)
        warmup = args.warmup if args.warmup is not None else warmup_steps(bench_config(args, "single", precision))
        times = medians(interleaved(runners, args.steps, warmup))
        for kind in args.backends:
            mine, peer = times[f"psarch {kind}"], times[peers[kind]]
            tflops = (fc.forward + fc.backward) / mine / 1e12
            rows.append({"precision": precision, "backend": kind, "peer": peers[kind], "params": params,
                         "psarch_ms": mine * 1e3, "peer_ms": peer * 1e3, "ratio": mine / peer,
                         "tflops": tflops, "mfu": tflops / peak if peak else None})
    if group is not None:
        dist.destroy_process_group()
    return rows


def gpu_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The peak dense TFLOPS of this GPU at `precision`, where psarch.cluster.device has its profile."""
    if device.type != "cuda":
        return None
    profile = vdevice.profile_of(torch.cuda.get_device_name(device))
    return vdevice.PROFILES[profile].get(precision) if profile else None


def format_rows(rows: list[StepRow]) -> str:
    lines = [f"{'precision':<10}{'psarch':<10}{'peer':<12}{'psarch ms':>11}{'peer ms':>10}{'ratio':>8}"
             f"{'TFLOP/s':>9}{'MFU':>7}"]
    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.3f}"
        lines.append(f"{r['precision']:<10}{r['backend']:<10}{r['peer']:<12}{r['psarch_ms']:>11.2f}"
                     f"{r['peer_ms']:>10.2f}{r['ratio']:>8.3f}{r['tflops']:>9.3f}{mfu:>7}")
    return "\n".join(lines)


def _csv(allowed: tuple[str, ...], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{what} {text!r}: allowed values are {', '.join(allowed)}")
        return items
    return parse


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="psarch bench step", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", type=_csv(("fp32", "bf16"), "--precision"), default=["fp32", "bf16"])
    with_peers = tuple(s.kind for s in registry.specs() if s.bench_peer)
    p.add_argument("--backends", type=_csv(with_peers, "--backends"), default=["single", "ddp", "zero"])
    p.add_argument("--steps", type=int, default=40, help="steps per runner, warm-up included")
    p.add_argument("--warmup", type=int, help="steps left out of the medians (default: the runner's rule, "
                                              "min(5, steps // 5))")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    args = p.parse_args(argv)
    if args.warmup is not None and args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup} (steps after warm-up are timed)")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    warmup = args.warmup if args.warmup is not None else min(5, args.steps // 5)
    print(f"{rows[0]['params'] / 1e6:.2f}M-parameter GPT, global batch {args.batch} x {args.seq_len} tokens, "
          f"{args.device} ({torch.get_num_threads()} threads), medians of {args.steps - warmup} interleaved steps")
    print(format_rows(rows))

