"""Can this machine host an emulated cluster? Asked before any process of a run starts."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from psarch.cluster import netns
from psarch.cluster.emulated import TSQ_SYSCTL, shaper

CAP_NET_ADMIN = 12
_HOW = ("run as root on Linux with iproute2 and the htb, bfifo and u32 traffic control modules, or without it: "
        "--set cluster.emulate=false")


def _capabilities() -> int:
    """This process's effective capability bits (0 where /proc does not say)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def missing(ip: str = "ip", tc: str = "tc", capability: int = CAP_NET_ADMIN) -> str | None:
    """None where this machine can emulate; else one line saying what is missing and how to run without
    [cluster] (the binaries, `capability`, the links' shaper installed in a scratch namespace). config's
    check_machine raises it as a ConfigError."""
    for tool in (ip, tc):
        if shutil.which(tool) is None:
            return f"cluster.emulate = true: `{tool}` (iproute2) is not installed; {_HOW}"
    if not _capabilities() >> capability & 1:
        return (f"cluster.emulate = true: needs root (capability {capability}"
                f"{' = CAP_NET_ADMIN' if capability == CAP_NET_ADMIN else ''} is missing); {_HOW}")
    probe = f"psarch-{os.getpid()}-probe"
    steps = [[ip, "netns", "add", probe], [ip, "-n", probe, "link", "add", "d0", "type", "veth", "peer", "name", "d1"],
             *([tc, "-n", probe, *argv] for argv in shaper("d0", 1.0, ["10.213.1.1"])),
             [ip, "-n", probe, "link", "set", "d0", "gso_max_segs", "1"]]
    try:
        for argv in steps:
            p = subprocess.run(argv, capture_output=True, text=True)
            if p.returncode != 0:
                err = (p.stderr.strip().splitlines() or ["failed"])[-1]
                return f"cluster.emulate = true: `{' '.join(argv[:7])}` failed ({err}); {_HOW}"
        try:
            with netns.inside(probe):
                Path(TSQ_SYSCTL).write_text("4096")
        except OSError as e:
            return f"cluster.emulate = true: cannot set a node's {TSQ_SYSCTL} ({e.strerror}); {_HOW}"
    finally:
        subprocess.run([ip, "netns", "del", probe], capture_output=True)
    return None
