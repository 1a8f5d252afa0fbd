"""Child processes die with their launcher: ranks and parameter servers never outlive `psarch run`,
even when it is killed with SIGKILL (which it cannot catch)."""
from __future__ import annotations

import ctypes
import multiprocessing as mp
from multiprocessing import forkserver
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
TICK_S = 0.02   # how often the launcher looks at its processes while it injects faults (supervise.watch): a
                # killed process is seen within one tick (failure_cost's predicted detection)
ECHO_GRACE_S = 2.0  # how long the launcher waits (this machine's clock, not stretched by D), after a rank fails, for
                    # its peers' errors before it names one (supervise.watch; part of a restart's detection)


def die_with_parent() -> None:
    """Call first thing in a child process. On Linux the kernel sends this process SIGKILL when its parent ends:
    a spawned child's parent is the launcher's thread that started it; a forkserver's child's
    (psarch.launch.processes) is the forkserver, which ends when the launcher does (when its "alive" pipe has no
    writer left: this child lets go of its copy here). Elsewhere it does nothing. If the launcher died before the
    signal was armed, exit now: the kernel will not send it any more."""
    if not sys.platform.startswith("linux"):
        return
    parent = mp.parent_process()
    if forkserver.get_inherited_fds() is not None:   # a forkserver's child
        # private: multiprocessing hands a forkserver's child the launcher's end of the forkserver's "alive" pipe
        # (to start children of its own through it) and gives no public way to let go of it
        alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
        if alive is not None:
            os.close(alive)
            setattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not permitted here (a sandbox): the launcher's own clean-up still ends this process
    # the launcher is gone: a spawned child's parent has changed; a forkserver's child's launcher end of its pipe
    # has closed (its parent, the forkserver, is another process)
    if parent is not None and os.getppid() != parent.pid and not parent.is_alive():
        os._exit(1)


def ended(code: int | None) -> str:
    """How a child process ended, from its exit code, for an error message: "was killed by SIGABRT",
    "exited with code 1". Never a guess: out of memory is named only as a sender of SIGKILL."""
    if code is None or code >= 0:
        return f"exited with code {code}"
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
    why = " (SIGKILL: the kernel's out-of-memory killer sends it, as does `kill -9`)" if code == -signal.SIGKILL else ""
    return f"was killed by {name}{why}"


def leave(code: int) -> None:
    """End this process now with `code`, its output flushed, without the interpreter's finalisation: a
    process that has written everything must not then die in it (gloo's threads abort at finalisation on
    torch 2.13, pytorch/pytorch#179291, even after destroy_process_group)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # closed or broken: nothing more can be said there anyway
            pass
    os._exit(code)
