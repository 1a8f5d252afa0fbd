"""`psarch run | compare | estimate | keys | server | keygen`."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from psarch.config import Config, ConfigError, allowed_values, applies_to, describe, load_config


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"keys": _keys, "compare": _compare, "estimate": _estimate, "keygen": _keygen, "server": _server,
                "run": _run_command}
    return commands[args.command](args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="psarch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub.add_parser("run", help="run an experiment config"))
    sub.add_parser("keys", help="list every config key: default, allowed values, meaning, where it applies")
    p_srv = sub.add_parser("server", help="run one parameter server standalone (multi-machine ps runs)")
    p_srv.add_argument("config")
    p_srv.add_argument("--index", type=int, required=True, help="which server (0 .. backend.servers-1)")
    p_srv.add_argument("--port", type=int, required=True, help="TCP port to bind")
    p_srv.add_argument("--host", help="address to bind (default: backend.host, 127.0.0.1)")
    p_srv.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p_key = sub.add_parser("keygen", help="write CURVE key pairs and PLAIN passwords for ps servers and workers")
    p_key.add_argument("dir", help="folder to write (set backend.keys to it)")
    p_key.add_argument("--workers", type=int, required=True, help="backend.world_size")
    p_key.add_argument("--servers", type=int, default=1, help="backend.servers")
    p_cmp = sub.add_parser("compare", help="compare run folders: report.md and plots")
    p_cmp.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p_cmp.add_argument("--out", help="folder for report.md and the PNG plots (default: runs/compare/<run names>)")
    p_cmp.add_argument("--target-gap", type=float,
                       help="convergence table: steps and time until the gap to the entropy floor falls below this "
                            "(default: half of the workload's initial gap)")
    _estimate_parser(sub.add_parser("estimate", help="analytic memory, traffic and step-time model (no processes)"))
    return parser


def _run_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable); the value is read as TOML")
    p.add_argument("--out", help="run folder (default: runs/<name>)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines (the summary, notes and errors are still printed)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", metavar="RUN_DIR",
                       help="continue that run from its latest complete checkpoint to train.steps; only name, label, "
                            "out, train.steps, train.log_every, train.checkpoint_every, train.keep_checkpoints, "
                            "backend.timeout_s and cluster.dilation may differ from the config it was written under (else use --from)")
    start.add_argument("--from", dest="start", metavar="CHECKPOINT_DIR",
                       help="a new run starting from that checkpoint's state and step, under this config")
    p.add_argument("--checkpoint", metavar="STEP",
                   help="with --resume: continue from this checkpoint of the run (step_000040, or 40) instead of "
                        "the latest; the later ones are removed")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a finished run in the run folder (a failed or interrupted one is replaced anyway)")
    p.add_argument("--rerun", action="store_true",
                   help="sweeps: run every point again (a point whose folder holds a finished run of the "
                        "same config is skipped otherwise)")


def _estimate_parser(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--overlap", type=float, default=0.0, help="fraction of communication hidden by compute")
    p.add_argument("--budget", type=float, default=32e9, help="device memory for Table 2, bytes")
    p.add_argument("--from", dest="from_run", help="take Φ, N, precision and compute time from a run folder")
    gpt = p.add_argument_group("tensor parallelism", "rows for a GPT of this shape at each degree t dividing --world")
    gpt.add_argument("--tensor-parallel", type=int, help="the degree t to mark (rows appear when given)")
    for flag, default, what in (("--layers", 24, "blocks"), ("--hidden", 2048, "width"), ("--heads", 16, "heads"),
                                ("--seq-len", 2048, "tokens per sequence"),
                                ("--micro-batch", 8, "sequences per data-parallel replica per step"),
                                ("--vocab", 50257, "vocabulary")):
        gpt.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")


def _keys(args: argparse.Namespace) -> int:
    for key, default, doc in describe():
        where = applies_to(key)
        print(f"{key:38} {json.dumps(default):>14}  {allowed_values(key):28}  {doc}"
              + ("" if where == "every backend" else f" [only {where}]"))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from psarch.compare import compare, default_out

    try:
        report = compare(args.runs, args.out or default_out(args.runs), args.target_gap)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"psarch: compare: {e}", file=sys.stderr)
        return 2
    print(report.read_text(), end="")
    print(f"(written to {report.parent})")
    return 0


def _keygen(args: argparse.Namespace) -> int:
    if args.workers < 1 or args.servers < 1:
        print(f"psarch: keygen: --workers {args.workers} --servers {args.servers}: both must be >= 1",
              file=sys.stderr)
        return 2
    from psarch.ps.auth import keygen

    folder = keygen(args.dir, args.workers, args.servers)
    print(f"keys for {args.workers} worker(s) and {args.servers} server(s) in {folder}; set "
          f"backend.keys = \"{folder}\" (servers need server{{j}}.key_secret and every worker{{i}}.key, "
          f"worker i needs worker{{i}}.key_secret, worker{{i}}.password and every server{{j}}.key)")
    return 0


def _server(args: argparse.Namespace) -> int:
    from psarch.ps.standalone import serve

    return serve(args.config, args.index, args.port, args.host, args.overrides)


def _run_command(args: argparse.Namespace) -> int:
    # SIGTERM (kill, timeout, a scheduler) stops a run as Ctrl-C does: ranks stopped, finished steps kept
    previous = signal.signal(signal.SIGTERM, _interrupt)  # main() runs in the main thread, as a program
    try:
        code = _run(args)
    except KeyboardInterrupt as e:
        print(f"psarch: interrupted{f' ({e})' if str(e) else ''}; finished steps are kept", file=sys.stderr)
        code = 128 + getattr(e, "signum", signal.SIGINT)
    except Exception as e:  # a failure nobody foresaw: one line; the traceback on request
        if os.environ.get("PSARCH_DEBUG"):
            raise
        print(f"psarch: run failed: {_one_line(e)} (PSARCH_DEBUG=1 shows the traceback)", file=sys.stderr)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    from psarch.dist import under_torchrun
    from psarch.lifecycle import leave
    if under_torchrun():   # this process held a gloo group: leave without the finalisation that can abort it
        leave(code)
    return code


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the launcher is, as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _interrupt(signum: int, frame: object) -> None:
    raise Terminated(signum)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _sweep_flags(args: argparse.Namespace) -> None:
    """A sweep resumes and replaces points by itself (a finished point of the same config is skipped, any
    other runs again; --rerun runs all): a single run's --resume or --overwrite would be ignored. (--from
    applies: every point forks that checkpoint.)"""
    given = [flag for flag, on in (("--resume", args.resume is not None), ("--overwrite", args.overwrite)) if on]
    if given:
        raise ConfigError(f"{args.config} is a sweep: {', '.join(given)} applies to one run only (a sweep skips its "
                          f"finished points and reruns the rest; --rerun runs every point again)")


def _run(args: argparse.Namespace) -> int:
    """`psarch run`: exit 2 on a config error (before any process starts), 1 when the run fails."""
    from psarch.sweep import read_sweep, run_sweep

    notes: list[str] = []
    try:  # the machine is checked once: by run() for one run, by the sweep's expand() for each point
        cfg = load_config(args.config, args.overrides, notes)
        for note in notes:
            print(f"psarch: note: {note}", file=sys.stderr)
        if args.checkpoint is not None and args.resume is None:
            raise ConfigError(f"--checkpoint {args.checkpoint}: picks the checkpoint of a --resume RUN_DIR; "
                              f"a new run names its checkpoint folder with --from")
        sweep = read_sweep(args.config)
        if sweep is not None:
            _sweep_flags(args)
            points = run_sweep(args.config, sweep, args.overrides, args.out, args.rerun, start=args.start,
                               progress=not args.quiet)
            return 1 if any(p.status == "failed" for p in points) else 0
    except ConfigError as e:
        print(f"psarch: config error: {e}", file=sys.stderr)
        return 2
    return _one_run(args, cfg)


def _one_run(args: argparse.Namespace, cfg: Config) -> int:
    from psarch.checkpoint import CheckpointError
    from psarch.launch import RunError, run
    from psarch.outputs import holds_finished_run, run_folder

    folder = run_folder(cfg, args.out)
    # a finished experiment is never lost by running a config again (under torchrun rank 0 decides: the
    # others may already see the folder it prepared)
    if (holds_finished_run(folder) and not args.overwrite and args.resume is None
            and os.environ.get("RANK", "0") == "0"):
        print(f"psarch: {folder} already holds a finished run; pass --overwrite to replace it, or choose another "
              f"folder with --out", file=sys.stderr)
        return 2
    try:
        run(cfg, args.resume or args.out, resume=args.resume is not None, start=args.start, pick=args.checkpoint,
            progress=not args.quiet)
    except ConfigError as e:  # found by the launcher before any rank starts (a factory's return type, a resume)
        print(f"psarch: config error: {e}", file=sys.stderr)
        return 2
    except (RunError, RuntimeError, OSError, ValueError) as e:
        # psarch's own errors say what failed; anything else (a factory's, torch's) also says its type
        said = str(e) if isinstance(e, (RunError, CheckpointError)) else _one_line(e)
        print(f"psarch: run {cfg.name!r} failed: {said}", file=sys.stderr)
        if os.environ.get("PSARCH_DEBUG"):
            raise
        return 1
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from psarch.estimate import Cluster, measured_compute, report
    from psarch.runs import load_run, run_config

    measured = None
    phi, world, precision, optimizer = args.params, args.world, args.precision, args.optimizer
    compute = args.compute_s
    if args.from_run:
        try:
            run = load_run(args.from_run)
            cfg = run_config(run)
        except (FileNotFoundError, ValueError) as e:   # ConfigError is a ValueError
            print(f"psarch: estimate --from {args.from_run}: {e}", file=sys.stderr)
            return 2
        summary = run["summary"]
        measured = (summary, cfg)
        phi = phi or summary["params"]
        world, precision, optimizer = cfg.backend.world_size, cfg.train.precision, cfg.train.optimizer
        compute = measured_compute(summary) if compute is None else compute
    if args.pipeline and (args.pipeline < 1 or world % args.pipeline or args.microbatches < 1):
        print(f"psarch: estimate: --pipeline {args.pipeline} must divide --world {world}, and --microbatches "
              f"must be >= 1", file=sys.stderr)
        return 2
    if not phi or phi <= 0 or world < 1 or args.servers < 1 or args.bandwidth <= 0 or args.latency < 0 \
            or (compute is not None and compute < 0):
        print("psarch: estimate: --params (> 0) or --from is required; --world, --servers >= 1; "
              "--bandwidth > 0; --latency, --compute-s >= 0", file=sys.stderr)
        return 2
    cluster = Cluster(args.bandwidth, args.latency, 0.1 if compute is None else compute, args.overlap)
    source = args.from_run if measured is not None and args.compute_s is None else None
    options = {"stages": args.pipeline, "microbatches": args.microbatches} if args.pipeline else {}
    try:
        tensor = _tensor_shape(args, world)
        print(report(phi, world, precision, optimizer, args.servers, cluster, args.budget, measured, source, options,
                     tensor), end="")
    except ConfigError as e:
        print(f"psarch: estimate: {e}", file=sys.stderr)
        return 2
    return 0


def _tensor_shape(args: argparse.Namespace, world: int) -> tuple | None:
    """(the GPT's shape, t) for --tensor-parallel t; a ConfigError naming the flag when it does not fit."""
    from psarch.estimate_tensor import GPTShape

    t = args.tensor_parallel
    if t is None:
        return None
    shape = GPTShape(args.layers, args.hidden, args.heads, args.seq_len, args.micro_batch, args.vocab)
    if min(shape.layers, shape.hidden, shape.heads, shape.seq, shape.micro_batch, shape.vocab) < 1:
        raise ConfigError("--layers, --hidden, --heads, --seq-len, --micro-batch, --vocab: each must be >= 1")
    if t < 1 or world % t or shape.heads % t or shape.hidden % shape.heads:
        raise ConfigError(f"--tensor-parallel {t}: must divide --world {world} and --heads {shape.heads} "
                          f"(and --heads must divide --hidden {shape.hidden})")
    return shape, t


if __name__ == "__main__":
    sys.exit(main())
