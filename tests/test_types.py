"""The library type-checks: mypy over psarch/, collective/ and zero/ (settings in pyproject.toml's [tool.mypy])
reports no error. mypy is in the dev extra, so a newcomer's `pytest` runs it (about 20 s cold, a few seconds
with its cache)."""
from __future__ import annotations

from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]


def test_the_library_type_checks():
    paths = [str(ROOT / p) for p in ("psarch", "collective", "zero")]
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                "--cache-dir", str(ROOT / ".mypy_cache"), *paths])
    assert status == 0, out + err
