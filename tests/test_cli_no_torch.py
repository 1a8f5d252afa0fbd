"""Answers that need no training do not import torch (seconds on a quiet machine): `--help`, `psarch keys`, and
a config with a typo'd key, in any section. Each runs the CLI's main in a fresh interpreter and reports whether torch got imported."""
from __future__ import annotations

import subprocess
import sys

import pytest
from timing import scaled

CHECK = """
import sys
from psarch.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("exit", code, "torch imported" if "torch" in sys.modules else "torch not imported", file=sys.stderr)
"""
TYPO = """
[workload]
model = "gpt"
[train]
stpes = 10
"""


def _torch_imported(tmp_path, *args: str) -> tuple[str, str]:
    (tmp_path / "bad.toml").write_text(TYPO)
    (tmp_path / "good.toml").write_text(TYPO.replace("stpes", "steps"))
    proc = subprocess.run([sys.executable, "-c", CHECK, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=scaled(120))
    return proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.parametrize("args, code", [
    (["run", "bad.toml"], 2),
    (["run", "bad.toml", "--set", "seeed=3"], 2),
    (["--help"], 0),
    (["run", "--help"], 0),
    (["estimate", "--help"], 0),
    (["bench", "--help"], 0),
    (["report", "--help"], 0),
])
def test_no_torch_for_help_and_config_errors(tmp_path, args, code):
    last, err = _torch_imported(tmp_path, *args)
    assert last == f"exit {code} torch not imported", err
    if args[0] == "run" and code == 2:
        assert "psarch: config error: " in err and "unknown key" in err


@pytest.mark.parametrize("args", [["keys"], ["run", "good.toml", "--set", "backend.wrld_size=2"]])
def test_no_torch_for_keys_and_backend_options(tmp_path, args):
    """`psarch keys` and a typo in a backend's option read every backend's spec: specs import their theory (which
    needs torch) only when asked for a prediction."""
    last, err = _torch_imported(tmp_path, *args)
    assert last.endswith("torch not imported"), err
