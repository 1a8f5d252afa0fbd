"""The `psarch` command run in the test's own process: psarch.cli.main, as `python -m psarch.cli` calls it, so a
test that reads a command's output does not start an interpreter (and import torch) for each call."""
from __future__ import annotations


def psarch_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`psarch ARGS`: its exit code (an argument parser's exit taken as the command's), stdout and stderr."""
    from psarch.cli import main

    capsys.readouterr()   # what the test printed before is not the command's
    said = ""
    try:
        code = main(list(args))
    except SystemExit as e:   # as the interpreter exits: None is 0, a message is said on stderr with 1
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        said = "" if e.code is None or isinstance(e.code, int) else f"{e.code}\n"
    got = capsys.readouterr()
    return code, got.out, got.err + said
