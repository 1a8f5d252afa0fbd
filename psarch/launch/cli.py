"""`psarch run`: one run or a sweep, from a config file. Exit 2 on a config error (before any process
starts), 1 when the run fails."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from psarch.config import Config, ConfigError, load_config


def add_parser(p: argparse.ArgumentParser) -> None:
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
                            "train.tensorboard, backend.timeout_s and cluster.dilation may differ from the config "
                            "it was written under (else use --from)")
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



def command(args: argparse.Namespace) -> int:
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
    dist = sys.modules.get("psarch.dist")   # not imported: no group was joined (a config error stops before)
    if dist is not None and dist.under_torchrun():   # this process held a gloo group: leave without the
        from psarch.launch.lifecycle import leave           # finalisation that can abort it

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
    notes: list[str] = []
    try:  # the machine is checked once: by run() for one run, by the sweep's expand() for each point
        cfg = load_config(args.config, args.overrides, notes)
        for note in notes:
            print(f"psarch: note: {note}", file=sys.stderr)
        if args.checkpoint is not None and args.resume is None:
            raise ConfigError(f"--checkpoint {args.checkpoint}: picks the checkpoint of a --resume RUN_DIR; "
                              f"a new run names its checkpoint folder with --from")
        from psarch.launch.sweep import read_sweep, run_sweep   # imports torch: after the config is known good

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
    from psarch.launch.ranks import RunError, run
    from psarch.launch.outputs import holds_finished_run, run_folder

    folder = run_folder(cfg, args.out)
    # a finished experiment is never lost by running a config again (under torchrun rank 0 decides: the
    # others may already see the folder it prepared)
    if (holds_finished_run(folder) and not args.overwrite and args.resume is None
            and os.environ.get("RANK", "0") == "0"):
        print(f"psarch: {folder} already holds a finished run; pass --overwrite to replace it, or choose another "
              f"folder with --out", file=sys.stderr)
        return 2
    try:
        summary = run(cfg, args.resume or args.out, resume=args.resume is not None, start=args.start,
                      pick=args.checkpoint, progress=not args.quiet)
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
    if summary:   # rank 0's (under torchrun the others return none)
        _plot(run_folder(cfg, args.resume or args.out))
    return 0


def _plot(folder: Path) -> None:
    """The run's own curves.png; a plot that cannot be drawn is a note, never a failed run."""
    from psarch.report.plot_run import write

    try:
        print(f"(loss and throughput plotted in {write(folder)}; psarch compare RUN_DIR... sets runs side by side)")
    except Exception as e:  # noqa: BLE001 (the run itself finished and is kept)
        print(f"psarch: note: no curves.png: {_one_line(e)}", file=sys.stderr)
