"""Every relative link in the project's READMEs names a file or folder that exists, and the top README stays a
map (at most 450 lines) whose details live in the READMEs it links."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted(p for p in ROOT.rglob("README.md") if not {".git", "runs", "node_modules"} & set(p.parts))


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(readme):
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme.read_text()):
        if "://" not in link:
            assert (readme.parent / link).exists(), f"{readme.relative_to(ROOT)} links to {link}, which is not there"


def test_the_top_readme_is_a_map():
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") <= 450
    assert not re.search(r"\bissue \d+", text, re.I), "the README names no issue numbers"
