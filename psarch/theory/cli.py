"""`psarch estimate`: the analytic memory, traffic and step-time model from the command line (no processes)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from psarch.config import ConfigError


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, help="parameter count Φ, e.g. 7.5e9")
    p.add_argument("--world", type=int, default=64, help="number of workers N")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--optimizer", default="adamw", choices=("sgd", "adamw", "adagrad"))
    p.add_argument("--servers", type=int, default=1, help="parameter servers")
    p.add_argument("--pipeline", type=int, default=0, metavar="P", help="pipeline stages p: adds pipeline rows")
    p.add_argument("--microbatches", type=int, default=8, metavar="M", help="micro-batches m (with --pipeline)")
    p.add_argument("--bandwidth", type=float, default=12.5e9, help="link bytes/s per direction")
    p.add_argument("--latency", type=float, default=10e-6, help="seconds per message")
    p.add_argument("--compute-s", type=float, help="compute seconds per step per worker (default: the --from "
                   "run's measured compute, else 0.1)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="send gradients after backward (default: from backward's hooks, backend.overlap_comm)")
    p.add_argument("--partition-mb", type=float, help="the PS's partitions, MiB (default: its own, backend.partition_mb)")
    p.add_argument("--budget", type=float, help="device memory for the ZeRO paper's Table 2, bytes (default 32e9; "
                   "with --from, the table is shown only when a budget is given)")
    p.add_argument("--from", dest="from_run", help="take Φ, N, precision and compute time from a run folder, or the "
                   "model (embedding tables: the hybrid's columns), samples per worker, Φ, N and precision from a "
                   "config file (.toml)")
    plan = p.add_argument_group("plan", "--plan: every architecture for the GPT of --layers .. --vocab (or, with "
                                "--from CONFIG.toml, that config's model: a DLRM's tables add the hybrid) on --world "
                                "devices, ranked by simulated step time")
    plan.add_argument("--plan", action="store_true", help="print the plan instead of the tables")
    plan.add_argument("--device", default="h100", help="the device profile (psarch.cluster.device.PROFILES)")
    plan.add_argument("--mfu", type=float, default=0.4, help="the fraction of the device's peak attained")
    plan.add_argument("--link-gbps", type=float, help="each node's link in Gbit/s (instead of --bandwidth)")
    gpt = p.add_argument_group("a GPT's shape", "the GPT asked about: its units (root and blocks) are ZeRO-3's in the "
                               "simulated steps (without --params, its Φ is Φ); tensor parallelism's rows at each "
                               "degree t dividing --world; --plan's model")
    gpt.add_argument("--tensor-parallel", type=int, help="the degree t to mark (rows appear when given)")
    for flag, default, what in (("--layers", 24, "blocks"), ("--hidden", 2048, "width"), ("--heads", 16, "heads"),
                                ("--seq-len", 2048, "tokens per sequence"),
                                ("--micro-batch", 8, "sequences per data-parallel replica per step (per device "
                                 "in --plan and the simulated model-parallel steps: one global batch for all)"),
                                ("--vocab", 50257, "vocabulary")):
        gpt.add_argument(flag, type=int, help=f"{what} (default {default})")   # None: not given (SHAPE_FLAGS)



def command(args: argparse.Namespace) -> int:
    from psarch.theory.estimate import measured_compute, report
    if args.plan:
        return _plan(args)
    given = _shape_given(args)
    from psarch.theory.estimate_steps import Network
    measured = None
    phi, world, precision, optimizer = args.params, args.world, args.precision, args.optimizer
    try:
        model = _gpt(args) if given else None
    except ConfigError as e:
        print(f"psarch: estimate: {e}", file=sys.stderr)
        return 2
    compute = args.compute_s
    asked = None
    if args.from_run:
        try:
            asked, summary = _asked(args.from_run)
        except (FileNotFoundError, ValueError) as e:   # ConfigError is a ValueError
            print(f"psarch: estimate --from {args.from_run}: {e}", file=sys.stderr)
            return 2
        if summary is not None:
            measured = (summary, asked)
            compute = measured_compute(summary) if compute is None else compute
        phi = phi or (summary["params"] if summary else _trainable(asked))
        world, precision, optimizer = asked.backend.world_size, asked.train.precision, asked.train.optimizer
    phi = phi or (model.params() if model else None)   # a GPT given alone: its own Φ
    if args.pipeline and (args.pipeline < 1 or world % args.pipeline or args.microbatches < 1):
        print(f"psarch: estimate: --pipeline {args.pipeline} must divide --world {world}, and --microbatches "
              f"must be >= 1", file=sys.stderr)
        return 2
    if not phi or phi <= 0 or world < 1 or args.servers < 1 or args.bandwidth <= 0 or args.latency < 0 \
            or (compute is not None and compute < 0) or (args.partition_mb is not None and args.partition_mb < 0):
        print("psarch: estimate: --params (> 0), a GPT's shape (--layers, ...) or --from is required; "
              "--world, --servers >= 1; "
              "--bandwidth > 0; --latency, --compute-s, --partition-mb >= 0", file=sys.stderr)
        return 2
    network = Network(args.bandwidth, args.latency, 0.1 if compute is None else compute, args.overlap)
    extra = {} if args.partition_mb is None else {"partition_mb": args.partition_mb}
    source = args.from_run if measured is not None and args.compute_s is None else None
    options = {"stages": args.pipeline, "microbatches": args.microbatches} if args.pipeline else {}
    try:
        tensor = _tensor_shape(args, world)
        gpt = _gpt(args) if tensor or args.pipeline else None
        print(report(phi, world, precision, optimizer, args.servers, network, args.budget, measured, source, options,
                     tensor, extra, gpt, model, asked), end="")
    except ConfigError as e:
        print(f"psarch: estimate: {e}", file=sys.stderr)
        return 2
    return 0


def _asked(path: str) -> tuple[Any, Any]:
    """(the config, the run's summary) of --from: a run folder, or a config file (.toml: nothing measured)."""
    if path.endswith(".toml"):
        from psarch.config import load_config

        return load_config(path), None
    from psarch.report.runs import load_run, run_config   # imports torch: only for a run folder

    run = load_run(path)
    return run_config(run), run["summary"]


def _trainable(cfg: Any) -> int:
    """Φ of a config's model: its parameters that train (counted on the meta device)."""
    from psarch.workload import theory_model

    return sum(p.numel() for p in theory_model(cfg).parameters() if p.requires_grad)


# the flags that shape the GPT asked about (--micro-batch is the batch, not the model)
SHAPE_FLAGS = ("layers", "hidden", "heads", "seq_len", "vocab")


def _shape_given(args: argparse.Namespace) -> bool:
    """Whether the command line names the GPT's shape (one of SHAPE_FLAGS)."""
    return any(getattr(args, f) is not None for f in SHAPE_FLAGS)


def _shape(args: argparse.Namespace) -> Any:
    """The GPT of --layers .. --vocab, each flag not given at GPTShape's default."""
    from psarch.theory.estimate_tensor import GPTShape

    fields = {"layers": "layers", "hidden": "hidden", "heads": "heads", "seq": "seq_len", "micro_batch": "micro_batch",
              "vocab": "vocab"}   # GPTShape's field: its flag's
    return GPTShape(**{f: getattr(args, flag) for f, flag in fields.items() if getattr(args, flag) is not None})


def _gpt(args: argparse.Namespace) -> Any:
    """The GPT of --layers .. --vocab (a ConfigError naming the flags when one is below 1)."""
    shape = _shape(args)
    if min(shape.layers, shape.hidden, shape.heads, shape.seq, shape.micro_batch, shape.vocab) < 1 \
            or shape.hidden % shape.heads:
        raise ConfigError("--layers, --hidden, --heads, --seq-len, --micro-batch, --vocab: each must be >= 1, and "
                          "--heads must divide --hidden")
    return shape


def _tensor_shape(args: argparse.Namespace, world: int) -> tuple | None:
    """(the GPT's shape, t) for --tensor-parallel t; a ConfigError naming the flag when it does not fit."""
    t = args.tensor_parallel
    if t is None:
        return None
    shape = _shape(args)
    if min(shape.layers, shape.hidden, shape.heads, shape.seq, shape.micro_batch, shape.vocab) < 1:
        raise ConfigError("--layers, --hidden, --heads, --seq-len, --micro-batch, --vocab: each must be >= 1")
    if t < 1 or world % t or shape.heads % t or shape.hidden % shape.heads:
        raise ConfigError(f"--tensor-parallel {t}: must divide --world {world} and --heads {shape.heads} "
                          f"(and --heads must divide --hidden {shape.hidden})")
    return shape, t


def _plan(args: argparse.Namespace) -> int:
    """`psarch estimate --plan`: the GPT of the shape flags, or with --from CONFIG.toml that config's model (its
    samples per device, precision and optimizer)."""
    from psarch.theory.plan import ConfigModel, Hardware, report

    bandwidth = args.bandwidth if args.link_gbps is None else args.link_gbps * 1e9 / 8
    precision, optimizer, bad_shape = args.precision, args.optimizer, False
    if args.from_run:
        if not args.from_run.endswith(".toml") or _shape_given(args):
            print("psarch: estimate --plan --from: a config file (.toml), without a GPT's shape flags (--layers ...)",
                  file=sys.stderr)
            return 2
        try:
            asked = _asked(args.from_run)[0]
        except (FileNotFoundError, ValueError) as e:   # ConfigError is a ValueError
            print(f"psarch: estimate --plan --from {args.from_run}: {e}", file=sys.stderr)
            return 2
        shape: Any = ConfigModel(asked.to_dict()["workload"], asked.train.global_batch // asked.backend.world_size,
                                 args.from_run)
        precision, optimizer = asked.train.precision, asked.train.optimizer
    else:
        shape = _shape(args)
        bad_shape = min(shape.layers, shape.hidden, shape.heads, shape.seq, shape.micro_batch, shape.vocab) < 1 \
            or shape.hidden % shape.heads != 0
    if bad_shape or args.world < 1 or bandwidth <= 0 or args.latency < 0 or not 0 < args.mfu <= 1:
        print("psarch: estimate --plan: --layers, --hidden, --heads (dividing --hidden), --seq-len, --micro-batch, "
              "--vocab, --world >= 1; --link-gbps or --bandwidth > 0; --latency >= 0; --mfu in (0, 1]; "
              "--from a config file only", file=sys.stderr)
        return 2
    try:
        print(report(shape, args.world, Hardware(args.device, args.mfu, bandwidth, args.latency), precision,
                     optimizer), end="")
    except ConfigError as e:
        print(f"psarch: estimate --plan: {e}", file=sys.stderr)
        return 2
    return 0
