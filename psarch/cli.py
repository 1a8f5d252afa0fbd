"""`psarch run | compare | estimate | keys`."""
from __future__ import annotations

import argparse
import os
import sys

from psarch.config import ConfigError, describe, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="psarch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run an experiment config")
    p_run.add_argument("config")
    p_run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a config key (repeatable); the value is read as TOML")
    p_run.add_argument("--out", help="run folder (default: runs/<name>)")
    p_run.add_argument("--quiet", action="store_true", help="no progress lines")
    sub.add_parser("keys", help="list every config key with its default and meaning")
    args = parser.parse_args(argv)

    if args.command == "keys":
        for key, default, doc in describe():
            print(f"{key:38} {default!r:>14}  {doc}")
        return 0
    if args.command == "run":
        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as e:
            print(f"psarch: config error: {e}", file=sys.stderr)
            return 2
        from psarch.launch import RunError, run

        try:
            run(cfg, args.out, echo=not args.quiet)
        except (RunError, ConfigError, RuntimeError, OSError, ValueError) as e:
            print(f"psarch: run {cfg.name!r} failed: {e}", file=sys.stderr)
            if os.environ.get("PSARCH_DEBUG"):
                raise
            return 1
        except KeyboardInterrupt:
            print("psarch: interrupted", file=sys.stderr)
            return 130
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
