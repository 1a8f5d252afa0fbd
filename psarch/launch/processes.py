"""Where the processes psarch starts on this machine come from (ranks, parameter servers, run_ranks' ranks): a
forkserver that imported torch and psarch's modules once, so a child starts in a fraction of a second instead of
importing them again (two to four CPU-s per process on a small machine).

A child started here gets what a spawned one got: the launcher's environment as it is at start() (set before its
target's module is imported; what torch read at its import, such as OMP_NUM_THREADS or TORCH_CPP_LOG_LEVEL, is the
environment the forkserver started with, once a launcher), its standard output and error as they are then (a redirected
run, pytest's capture), its working folder and sys.path (multiprocessing sends those; the modules the forkserver
preloaded come from the launcher's sys.path as it was at start_server: _import_path), and a parent that ends
with the launcher (psarch.launch.lifecycle.die_with_parent). The forkserver only imports: no ZeroMQ context, no
process group and no CUDA context (torch's import starts none), so a fork of it holds none either; the one thread
the import starts, OpenBLAS's, OpenBLAS itself stops around a fork (pthread_atfork).

A child also runs in the network namespace the launcher's thread stands in when it starts it (an emulated cluster's
node, a namespace that thread entered): the launcher hands it that namespace, and a forkserver's child, born in the
forkserver's, enters it before its target runs (psarch.cluster.netns.enter; nothing to do where they are the same).
What such a child cannot take from the launcher is what torch read at its import: an emulated run's nodes need
c10's log level (imports_env), so the forkserver serves them only where it imported torch with it; start_server
starts it again with it where one started otherwise (a loopback run's, earlier in this process) runs. It serves a
node only where it listens on a path, which a thread inside a node reaches (Python's since 3.11), not on an abstract
socket name, which belongs to one network namespace (`serves`, on its own address). Where it cannot serve, each
child is spawned (`spawn`) and node_context says so in one line."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import threading
import weakref
from multiprocessing import forkserver, reduction, util
from multiprocessing.context import BaseContext, ForkServerProcess
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterator

# What every child imports anyway, imported once in the forkserver: torch, and torch._dynamo, which torch.optim imports
# when a process builds its first optimizer (as much CPU again as torch itself); and psarch's modules a rank or a
# server runs (preload()), most of a small run's start-up else (a child's own imports of them: about 0.4 s each). A
# workload factory that patches a psarch function must patch it where it is looked up, in each module that imported
# it by name, as with any module imported before it (unittest.mock's "where to patch").
TORCH_PRELOAD = ("torch", "torch.distributed", "torch._dynamo")
READY_S = 600.0   # the forkserver's imports and first child, however loaded the machine: past this it is stuck


# The forkserver this module started: its pid and what its torch read at its import, of IMPORT_KEYS (None: none yet)
IMPORT_KEYS = ("TORCH_CPP_LOG_LEVEL",)
_started: tuple[int, dict[str, str | None]] | None = None
_said: set[str] = set()   # node_context's notes, each said once a process


def preload() -> list[str]:
    """What the forkserver imports before its first child: torch's modules, the launcher's entry points of a rank
    and of a server, and the built-in backends' specs (not a plugin's: its module is the user's)."""
    from psarch import registry
    return [*TORCH_PRELOAD, "psarch.launch.ranks", "psarch.ps.services", *registry.builtin_modules()]


def context() -> BaseContext:
    """The forkserver context, its preload set, the forkserver started (start_server)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload())
    start_server()
    return ctx


def start_server(env: dict[str, str] | None = None) -> None:
    """Start the forkserver now, its imports (seconds) with it, so that no world's start-up pays for them: the first
    world's would, and a restart's, found it running, would be predicted from it (psarch.launch.failure_cost).
    `env`: variables of IMPORT_KEYS its imports read (an emulated node's c10 log level), set for its start only.
    One running that this module started with other values of them (a loopback run's, before an emulated one) is
    replaced; one whose children still run is kept (`serves` tells). Call it outside any node: the forkserver lives
    in this machine's own network namespace."""
    global _started
    imported = _imported()
    if imported is not None and all(imported.get(k) == v for k, v in (env or {}).items() if k in IMPORT_KEYS):
        return
    if address() is not None and not _retire():
        return
    with environ({**(env or {}), **_import_path()}):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(preload())
        forkserver.ensure_running()
        # ensure_running returns at once, its imports under way: the first child waits for them. This one, here.
        first = ctx.Process(target=_nothing, name="psarch-forkserver-ready")  # type: ignore[attr-defined]
        first.start()
        first.join(READY_S)
        if first.exitcode != 0:
            first.kill()
            raise RuntimeError(f"psarch's forkserver did not start a child within {READY_S:g} s (its first child: "
                               f"exit code {first.exitcode}; None: still running)")
        _started = (_server()._forkserver_pid, {k: os.environ.get(k) for k in IMPORT_KEYS})


def _import_path() -> dict[str, str]:
    """The environment that makes the forkserver import from this process's sys.path, in its order: Python 3.11's
    forkserver ignores the sys.path multiprocessing hands it, and would take its own (its working folder first,
    then $PYTHONPATH), so the psarch it preloads could be another checkout's than the launcher's."""
    return {"PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path), "PYTHONSAFEPATH": "1"}


def _server() -> Any:
    """multiprocessing's forkserver, this process's (multiprocessing.forkserver's module state: its pid, the address
    it listens on, the pipe that keeps it alive; private, the same in Python 3.11 to 3.14, where 3.14 adds an
    authentication key)."""
    return forkserver._forkserver


def address() -> str | bytes | None:
    """The address the running forkserver listens on, as multiprocessing connects to it (None: none started in this
    process): a path, or a name in the abstract namespace (beginning with a NUL byte)."""
    return _server()._forkserver_address


def _imported() -> dict[str, str | None] | None:
    """What the running forkserver's torch read at its import, where this module started it (None where it did not,
    or where multiprocessing has started another since)."""
    if _started is None or _server()._forkserver_pid != _started[0]:
        return None
    return _started[1]


def _retire() -> bool:
    """Stop using the running forkserver, without waiting for it: it ends when its last child has (each holds its
    alive pipe) and a thread here reaps it; multiprocessing's own stop (ForkServer._stop) would wait for all of them.
    False, and nothing done, while a child it forked runs: its exit code comes back through the forkserver, which
    could end before it said it."""
    if any(isinstance(p, ForkServerProcess) for p in mp.active_children()):
        return False
    fs = _server()
    with fs._lock:
        pid, where, alive = fs._forkserver_pid, fs._forkserver_address, fs._forkserver_alive_fd
        for attr in ("_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_authkey"):
            if hasattr(fs, attr):
                setattr(fs, attr, None)
    if alive is not None:
        os.close(alive)
    if where is not None and not util.is_abstract_socket_namespace(where):
        with contextlib.suppress(OSError):
            os.unlink(where)
    if pid is not None:
        threading.Thread(target=_reap, args=(pid,), name="psarch-forkserver-reaper", daemon=True).start()
    return True


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


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
    """Whether the running forkserver makes the children a thread in any network namespace would spawn with `env`."""
    return not _cannot_serve(env)


def _cannot_serve(env: dict[str, str]) -> str:
    """Why the running forkserver cannot serve a node's processes with `env` ('' where it can): it listens on a
    path, which a thread inside a node reaches, not on an abstract socket name, which belongs to this machine's
    network namespace; this module started it, and its torch read env's values of IMPORT_KEYS."""
    imported, where = _imported(), address()
    if where is None:
        return "psarch's forkserver is not running"
    if imported is None:
        return "the running forkserver is not the one psarch started, and a child it forked still runs"
    if util.is_abstract_socket_namespace(where):
        return f"psarch's forkserver listens on an abstract socket name ({where!r}), which no node reaches"
    wrong = {k: v for k, v in env.items() if k in IMPORT_KEYS and imported.get(k) != v}
    if wrong:
        had = ", ".join(f"{k} unset" if imported.get(k) is None else f"{k}={imported.get(k)}" for k in wrong)
        return (f"psarch's forkserver imported torch with {had}, not {', '.join(f'{k}={v}' for k, v in wrong.items())}"
                f", and a child it forked still runs")
    return ""


def node_context(env: dict[str, str]) -> BaseContext:
    """Where the processes started inside an emulated cluster's nodes come from: the forkserver, (re)started to
    import torch with `env` (start_server); where it cannot serve them, a spawned interpreter each (seconds of CPU
    more in every start-up), said once in one line on standard error."""
    start_server(env)
    why = _cannot_serve(env)
    if not why:
        return context()
    if why not in _said:
        _said.add(why)
        print(f"psarch: note: {why}: each process on a node is spawned (it imports torch itself)", file=sys.stderr,
              flush=True)
    return spawn()


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
