"""Network namespaces through iproute2: run `ip`/`tc`, enter a namespace, list, empty and delete them.

iproute2 by subprocess rather than pyroute2: a dozen short commands per run, no new dependency, and the
commands are the ones a user types to inspect a run (`ip netns list`, `tc -n NS qdisc show`)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
from typing import Iterator

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(RuntimeError):
    """An `ip`/`tc` command failed; the message names the command and its error output."""


def run(*argv: str, check: bool = True) -> str:
    """Run one iproute2 command; its stdout (raises NetnsError with the command's stderr if it fails)."""
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed: {p.stderr.strip() or p.returncode}")
    return p.stdout


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def enter(fd: int) -> None:
    """Move this thread, for good, into the network namespace `fd` refers to (an open /proc/.../ns/net or
    /run/netns file); nothing where it is there already (no privilege needed then)."""
    here, there = os.stat("/proc/thread-self/ns/net"), os.fstat(fd)
    if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
        _setns(fd)


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """Run the block with this thread in namespace `ns`. A network namespace belongs to a thread: sockets
    the block opens, and processes or threads it starts, stay in `ns`; the thread returns after the block."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(home)


def names(prefix: str) -> list[str]:
    """The namespaces whose name starts with `prefix`."""
    out = run("ip", "-j", "netns", "list", check=False).strip()
    return [n["name"] for n in json.loads(out or "[]") if n["name"].startswith(prefix)]


def pids(ns: str) -> list[int]:
    """Processes whose network namespace is `ns`."""
    return [int(p) for p in run("ip", "netns", "pids", ns, check=False).split()]


def remove(ns: str) -> None:
    """Kill what still runs in `ns`, then delete it (its veths and bridge go with it). Missing: no error."""
    for pid in pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run("ip", "netns", "del", ns, check=False)


def link_bytes(ns: str) -> dict[str, tuple[int, int]]:
    """{interface: (bytes transmitted, bytes received)} in `ns`, from the kernel's counters (headers included)."""
    return {name: (tx[0], rx[0]) for name, (tx, rx) in link_stats(ns).items()}


def link_stats(ns: str) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """{interface: ((bytes, packets) transmitted, (bytes, packets) received)} in `ns`, the kernel's counters."""
    out = json.loads(run("ip", "-n", ns, "-s", "-j", "link", "show"))
    return {d["ifname"]: ((d["stats64"]["tx"]["bytes"], d["stats64"]["tx"]["packets"]),
                          (d["stats64"]["rx"]["bytes"], d["stats64"]["rx"]["packets"])) for d in out}


def tcp_counters(ns: str) -> dict[str, int]:
    """{"Tcp.RetransSegs": n, "TcpExt.TCPSACKReorder": n, ...}: namespace `ns`'s protocol counters
    (/proc/net/snmp and /proc/net/netstat, what `nstat -az` shows), read from inside `ns`."""
    out: dict[str, int] = {}
    with inside(ns):
        for path in ("/proc/thread-self/net/snmp", "/proc/thread-self/net/netstat"):
            lines = open(path).read().splitlines()
            for names, values in zip(lines[::2], lines[1::2]):
                group, *keys = names.split()
                out.update({f"{group.rstrip(':')}.{k}": int(v) for k, v in zip(keys, values.split()[1:])})
    return out


def tcp_retransmitted(ns: str) -> int:
    """TCP segments `ns` has retransmitted (Tcp RetransSegs: timeouts, fast retransmits and tail loss probes alike)."""
    return tcp_counters(ns)["Tcp.RetransSegs"]
