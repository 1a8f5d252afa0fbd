"""Where the processes psarch starts on this machine come from (ranks, parameter servers, run_ranks' ranks): a
forkserver that imported torch once, so a child starts in a fraction of a second instead of importing torch again
(two to four CPU-s per process on a small machine).

A child started here gets what a spawned one got: the launcher's environment as it is at start() (set before its
target's module is imported; what torch read at its import, such as OMP_NUM_THREADS or TORCH_CPP_LOG_LEVEL, is the
environment the forkserver started with, once a launcher), its standard output and error as they are then (a redirected
run, pytest's capture), its working folder and sys.path (multiprocessing sends those), and a parent that ends
with the launcher (psarch.launch.lifecycle.die_with_parent). The forkserver only imports: no ZeroMQ context, no
process group and no CUDA context (torch's import starts none), so a fork of it holds none either; the one thread
the import starts, OpenBLAS's, OpenBLAS itself stops around a fork (pthread_atfork).

A child that must be born where the launcher's thread stands (inside an emulated cluster's node, a network
namespace that thread entered) is spawned instead (`spawn`): a forkserver's children are born where it is."""
from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import forkserver, reduction
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable

# What every child imports anyway and what costs it most, imported once in the forkserver: torch, and torch._dynamo,
# which torch.optim imports when a process builds its first optimizer (as much CPU again as torch itself). Not
# psarch: a child imports psarch's modules itself (about 0.2 CPU-s), in the order a spawned child does, so a
# workload factory that patches a psarch function before another module imports it by name works as it did.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")


def context() -> BaseContext:
    """The forkserver context, its preload set (it takes effect when the forkserver starts: once a process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def start_server() -> None:
    """Start the forkserver now, its imports (seconds) with it, so that no world's start-up pays for them: the first
    world's would, and a restart's, found it running, would be predicted from it (psarch.launch.failure_cost)."""
    context()
    forkserver.ensure_running()


def spawn() -> BaseContext:
    """A fresh interpreter per child, born where the calling thread stands (its network namespace)."""
    return mp.get_context("spawn")


def process(ctx: BaseContext, target: Callable[..., Any], args: tuple = (), name: str | None = None,
            daemon: bool | None = None) -> BaseProcess:
    """ctx.Process(target=target, args=args, ...) that runs with this process's environment and standard output
    and error as they are when it starts."""
    return ctx.Process(target=_run, args=(_Launcher(), target, args), name=name,  # type: ignore[attr-defined]
                       daemon=daemon)


class _Launcher:
    """Pickled when a child starts (not when it is built): the environment and standard streams of then."""

    def __reduce__(self) -> tuple[Callable[..., None], tuple]:
        return _adopt, (dict(os.environ), _stream(1), _stream(2))


def _stream(fd: int) -> Any:
    """fd, passed to the child (multiprocessing's own way, for spawn and forkserver alike); None if closed."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return reduction.DupFd(fd)


def _adopt(environ: dict[str, str], out: Any, err: Any) -> None:
    """In the child, as it unpickles its target: the launcher's environment and standard streams."""
    os.environ.clear()
    os.environ.update(environ)
    for fd, held in ((1, out), (2, err)):
        if held is not None:
            got = held.detach()
            if got != fd:   # a forkserver's child receives a new descriptor; a spawned one, fd itself
                os.dup2(got, fd)
                os.close(got)


def _run(_: None, target: Callable[..., Any], args: tuple) -> None:
    target(*args)
