"""`psarch run | compare | report | estimate | bench | keys | server | keygen`."""
from __future__ import annotations

import argparse
import json
import sys

from psarch import bench, report
from psarch.config import allowed_values, applies_to, describe
from psarch.launch import cli as cli_run
from psarch.theory import cli as cli_estimate

# Nothing here imports torch at module level (nor do cli_run, cli_estimate, and bench and report import their
# modules only when one is run): `--help`, `keys` and a config error answer without the seconds torch takes to
# import.


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"keys": _keys, "compare": _compare, "estimate": cli_estimate.command, "keygen": _keygen,
                "server": _server, "run": cli_run.command, "bench": _bench, "report": _report}
    return commands[args.command](args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="psarch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cli_run.add_parser(sub.add_parser("run", help="run an experiment config"))
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
                            "(default: convergence_target x the workload's initial gap)")
    p_rep = sub.add_parser("report", help="a study's table from its sweep folders (the arguments are the report's own)",
                           description="Write and print a study's table from run folders. `psarch report NAME --help` "
                                       "gives a report's own arguments.")
    p_rep.add_argument("name", choices=report.NAMES)
    p_rep.add_argument("args", nargs=argparse.REMAINDER, help="the report's arguments, e.g. the sweep folder")
    cli_estimate.add_parser(sub.add_parser("estimate", help="analytic memory, traffic and step-time model (no processes)"))
    p_bench = sub.add_parser("bench", help="a benchmark against PyTorch's own peer (the arguments are its own)",
                             description="Run one benchmark: psarch beside the peer a user would otherwise run, ratios "
                                         "printed. `psarch bench NAME --help` gives a benchmark's own arguments.")
    p_bench.add_argument("name", choices=bench.NAMES)
    p_bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")
    return parser


def _keys(args: argparse.Namespace) -> int:
    for key, default, doc in describe():
        where = applies_to(key)
        print(f"{key:38} {json.dumps(default):>14}  {allowed_values(key):28}  {doc}"
              + ("" if where == "every backend" else f" [only {where}]"))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from psarch.report.compare import compare, default_out

    try:
        report = compare(args.runs, args.out or default_out(args.runs), args.target_gap)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"psarch: compare: {e}", file=sys.stderr)
        return 2
    print(report.read_text(), end="")
    print(f"(written to {report.parent})")
    return 0


def _bench(args: argparse.Namespace) -> int:
    return bench.run(args.name, args.args)


def _report(args: argparse.Namespace) -> int:
    return report.run(args.name, args.args)


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


if __name__ == "__main__":
    sys.exit(main())
