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

A child also runs in the network namespace the launcher's thread stands in when it starts it (an emulated cluster's
node, a namespace that thread entered): the launcher hands it that namespace, and a forkserver's child, born in the
forkserver's, enters it before its target runs (psarch.cluster.netns.enter; nothing to do where they are the same).
What such a child cannot take from the launcher is what torch read at its import: an emulated run's nodes need
c10's log level (imports_env), so the forkserver serves them only where it imported torch with it (`serves`; a
spawned child otherwise, `spawn`)."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import weakref
from multiprocessing import forkserver, reduction
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterator

# What every child imports anyway and what costs it most, imported once in the forkserver: torch, and torch._dynamo,
# which torch.optim imports when a process builds its first optimizer (as much CPU again as torch itself). Not
# psarch: a child imports psarch's modules itself (about 0.2 CPU-s), in the order a spawned child does, so a
# workload factory that patches a psarch function before another module imports it by name works as it did.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")
READY_S = 600.0   # the forkserver's imports and first child, however loaded the machine: past this it is stuck


# What the forkserver's torch read at its import, of IMPORT_KEYS (None: not started by this module yet)
IMPORT_KEYS = ("TORCH_CPP_LOG_LEVEL",)
_imported_with: dict[str, str | None] | None = None


def context() -> BaseContext:
    """The forkserver context, its preload set, the forkserver started (start_server)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    start_server()
    return ctx


def start_server(env: dict[str, str] | None = None) -> None:
    """Start the forkserver now, its imports (seconds) with it, so that no world's start-up pays for them: the first
    world's would, and a restart's, found it running, would be predicted from it (psarch.launch.failure_cost).
    `env`: variables of IMPORT_KEYS its imports read (an emulated node's c10 log level), set for its start only;
    a forkserver already running keeps what it read (`serves` tells)."""
    global _imported_with
    if _imported_with is not None:
        return
    with environ(env or {}):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        forkserver.ensure_running()
        # ensure_running returns at once, its imports under way: the first child waits for them. This one, here.
        first = ctx.Process(target=_nothing, name="psarch-forkserver-ready")  # type: ignore[attr-defined]
        first.start()
        first.join(READY_S)
        if first.exitcode != 0:
            first.kill()
            raise RuntimeError(f"psarch's forkserver did not start a child within {READY_S:g} s (its first child: "
                               f"exit code {first.exitcode}; None: still running)")
        _imported_with = {k: os.environ.get(k) for k in IMPORT_KEYS}


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """This process's environment with `env` set, as it was again when the block ends."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def serves(env: dict[str, str]) -> bool:
    """Whether the forkserver (started here) makes the children a thread in any network namespace would spawn with
    `env`: it imported torch with env's values of IMPORT_KEYS, and it listens on a path (Python 3.11's), which a
    thread inside a node reaches, not on an abstract socket name, which belongs to one network namespace."""
    from multiprocessing import connection
    # where the forkserver's address comes from (multiprocessing's own helper; typeshed does not list it)
    path = not connection.arbitrary_address("AF_UNIX").startswith("\0")  # type: ignore[attr-defined]
    return path and _imported_with is not None and all(_imported_with.get(k) == v for k, v in env.items()
                                                       if k in IMPORT_KEYS)


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
    """Pickled when a child starts (not when it is built): the environment, standard streams and network namespace
    of then (the starting thread's)."""

    def __reduce__(self) -> tuple[Callable[..., None], tuple]:
        return _adopt, (dict(os.environ), _stream(1), _stream(2), self._namespace())

    def _namespace(self) -> Any:
        """The starting thread's network namespace, passed to the child as a descriptor (None where /proc does not
        show it). Held open until the child has it: closed when this object goes, once the child has started."""
        try:
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        except OSError:
            return None
        weakref.finalize(self, os.close, fd)
        return reduction.DupFd(fd)


def _stream(fd: int) -> Any:
    """fd, passed to the child (multiprocessing's own way, for spawn and forkserver alike); None if closed."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return reduction.DupFd(fd)


def _adopt(environ: dict[str, str], out: Any, err: Any, namespace: Any = None) -> None:
    """In the child, as it unpickles its target: the launcher's environment, standard streams and network namespace."""
    os.environ.clear()
    os.environ.update(environ)
    for fd, held in ((1, out), (2, err)):   # first: a namespace that cannot be entered is said where the launcher reads
        if held is not None:
            got = held.detach()
            if got != fd:   # a forkserver's child receives a new descriptor; a spawned one, fd itself
                os.dup2(got, fd)
                os.close(got)
    if namespace is not None:
        from psarch.cluster import netns
        fd = namespace.detach()
        try:
            netns.enter(fd)
        finally:
            os.close(fd)


def _run(_: None, target: Callable[..., Any], args: tuple) -> None:
    target(*args)


def _nothing() -> None:
    """The forkserver's first child (start_server): it only shows the forkserver has finished its imports."""
