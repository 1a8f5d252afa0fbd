"""What the emulated-cluster tests share: skip where this machine cannot emulate, and check nothing is left."""
from __future__ import annotations

import subprocess

import pytest



def can_emulate() -> str:
    """'' where an emulated cluster can be built here, else why not."""
    from psarch.cluster.preflight import missing
    return missing() or ""


needs_root = pytest.mark.skipif(bool(can_emulate()), reason="no emulated cluster here: " + can_emulate())


def leftovers(pid: int) -> list[str]:
    """Namespaces (and processes inside them) that the run of launcher `pid` left behind."""
    from psarch.cluster import netns
    left = netns.names(f"psarch-{pid}-")
    return left + [f"pid {p} in {ns}" for ns in left for p in netns.pids(ns)]


def watchers(pid: int) -> list[str]:
    """Clean-up watchers of launcher `pid` still running."""
    out = subprocess.run(["pgrep", "-f", f"watch.py psarch-{pid}-"], capture_output=True, text=True).stdout
    return out.split()
