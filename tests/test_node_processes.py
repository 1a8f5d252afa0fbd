"""A process psarch starts runs in the network namespace the launcher's thread stands in when it starts it (an
emulated cluster's node), also when psarch's forkserver, which lives in this machine's own namespace, forks it:
so an emulated run's ranks need not each import torch again (psarch.launch.processes). The forkserver serves a node
also where a loopback run started it first in the same process, and whether it can is asked of the address it
listens on."""
from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing import connection, forkserver
from pathlib import Path

import pytest

from cluster_setup import needs_root
from psarch.cluster import netns
from psarch.launch import processes
from timing import scaled

TESTS = Path(__file__).resolve().parent


def where_am_i(conn) -> None:
    """In the child: its network namespace (device, inode) and its parent's pid."""
    st = os.stat("/proc/self/ns/net")
    conn.send((st.st_dev, st.st_ino, os.getppid()))
    conn.close()


def _started(ctx, ns: str | None) -> tuple[int, int, int]:
    mine, theirs = ctx.Pipe()
    p = processes.process(ctx, where_am_i, (theirs,))
    if ns is None:
        p.start()
    else:
        with netns.inside(ns):
            p.start()
    theirs.close()
    try:
        assert mine.poll(60), "the child said nothing within 60 s"
        return mine.recv()
    finally:
        p.join(30)
        assert p.exitcode == 0, p.exitcode


@needs_root
def test_a_forkserver_child_runs_in_the_node_it_was_started_in():
    ns = f"psarch-{os.getpid()}-proc"   # a run's prefix: a later run removes it should this test die first
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        ctx = processes.context()
        node, host = os.stat(f"/run/netns/{ns}"), os.stat("/proc/self/ns/net")
        dev, ino, parent = _started(ctx, ns)
        assert (dev, ino) == (node.st_dev, node.st_ino), "the child is not in the node's namespace"
        assert parent != os.getpid(), "the child was not forked by the forkserver: nothing was entered"
        dev, ino, _ = _started(ctx, None)
        assert (dev, ino) == (host.st_dev, host.st_ino), "a child started outside any node left this namespace"
        assert not netns.pids(ns), "a child outlived its test inside the node"
    finally:
        netns.remove(ns)
    assert ns not in netns.names(f"psarch-{os.getpid()}-")


def _fresh(script: str, *args: str) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter (its own forkserver, none started yet), with this psarch and these tests."""
    path = [str(TESTS), str(Path(processes.__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    env.pop("TORCH_CPP_LOG_LEVEL", None)   # a loopback run's forkserver then imports torch at c10's default level
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=scaled(300))


LOOPBACK_THEN_NODE = """
import os, sys
from psarch.cluster.placement import Emulated, imports_env
from psarch.launch import processes
import test_node_processes as t

processes.start_server(imports_env(False))   # a loopback run's start (psarch.launch.ranks), first in this process
processes.start_server(imports_env(True))    # then an emulated run's
ctx = Emulated.__new__(Emulated).context()   # its placement's (only context() is asked: no cluster is built)
print(*t._started(ctx, sys.argv[1]), os.getpid())
"""


@needs_root
@pytest.mark.slow
def test_an_emulated_run_after_a_loopback_run_forks_its_ranks_into_their_nodes():
    """A loopback run's forkserver imported torch at c10's default log level, where a node's process needs ERROR
    (placement.imports_env): the emulated run that follows in the same process starts it again with it, and its
    ranks are forked from it into their nodes, not spawned (the old code spawned them and said nothing)."""
    ns = f"psarch-{os.getpid()}-proc"   # a run's prefix: a later run removes it should this test die first
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        proc = _fresh(LOOPBACK_THEN_NODE, ns)
        assert proc.returncode == 0, proc.stderr[-3000:]
        dev, ino, parent, launcher = map(int, proc.stdout.split()[-4:])
        node = os.stat(f"/run/netns/{ns}")
        assert (dev, ino) == (node.st_dev, node.st_ino), "the child is not in the node's namespace"
        assert parent != launcher, "the child was spawned by the launcher, not forked by its forkserver"
        assert "spawned" not in proc.stderr, proc.stderr[-3000:]
        assert not netns.pids(ns), "a child outlived its test inside the node"
    finally:
        netns.remove(ns)


def test_serves_asks_the_address_the_running_forkserver_listens_on(monkeypatch):
    """An abstract socket name belongs to one network namespace: a forkserver that listens on one serves no node,
    whatever address multiprocessing would make now (connection.arbitrary_address, a path since Python 3.11); and one
    that listens on a path does, whatever that would be."""
    processes.start_server()
    state = forkserver._forkserver
    assert processes.serves({}), "psarch's running forkserver, on a path, does not serve"
    monkeypatch.setattr(connection, "arbitrary_address", lambda family: f"\0psarch-fresh-{family}")
    assert processes.serves({}), "a fresh address decided, not the one the forkserver listens on"
    monkeypatch.undo()
    monkeypatch.setattr(state, "_forkserver_address", f"\0psarch-abstract-{os.getpid()}")
    assert not processes.serves({}), "a forkserver on an abstract socket name was said to serve a node"
    assert processes.address() == state._forkserver_address


def test_a_node_context_says_in_one_line_where_it_spawns(monkeypatch, capsys):
    """Where the forkserver cannot serve a node, each of its processes is spawned (seconds of CPU more at every
    start-up), and the run says so once, in one line."""
    processes.start_server()
    abstract = f"\0psarch-abstract-{os.getpid()}-note"
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_address", abstract)
    assert processes.node_context({}).get_start_method() == "spawn"   # {}: psarch's forkserver serves as it is
    assert processes.node_context({}).get_start_method() == "spawn"
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "abstract socket name" in said[0] and "spawned" in said[0], said
    monkeypatch.undo()
    assert processes.node_context({}).get_start_method() == "forkserver"


def wait_for(conn) -> None:
    """In the child: run until the test says, then leave with exit code 3."""
    conn.recv()
    sys.exit(3)


KEPT_THEN_REPLACED = """
import multiprocessing as mp, os
from multiprocessing import forkserver
from psarch.launch import processes
import test_node_processes as t

ctx = processes.context()                      # a loopback run's forkserver
first = forkserver._forkserver._forkserver_pid
mine, theirs = ctx.Pipe()
child = processes.process(ctx, t.wait_for, (theirs,), daemon=True)   # ended at exit, should this script fail
child.start()
node = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
processes.start_server(node)                   # its child runs: it is kept
kept = forkserver._forkserver._forkserver_pid
assert kept == first and not processes.serves(node), (first, kept)
assert processes.node_context(node).get_start_method() == "spawn"
mine.send(None)
child.join(60)
assert child.exitcode == 3, f"the running child's exit code: {child.exitcode}"
processes.start_server(node)                   # no child left: replaced
assert forkserver._forkserver._forkserver_pid not in (None, first) and processes.serves(node)
assert processes.node_context(node).get_start_method() == "forkserver"
again = processes.process(ctx, t.wait_for, (theirs,), daemon=True)
again.start()
mine.send(None)
again.join(60)
assert again.exitcode == 3, f"a child of the new forkserver: exit code {again.exitcode}"
print("ok")
"""


@pytest.mark.slow
def test_a_forkserver_with_a_running_child_is_kept_and_replaced_once_it_ended():
    """A forkserver is replaced only when no child it forked runs (a child's exit code comes back through it): while
    one runs, a node's processes are spawned and the run says so in one line; once it has ended, the forkserver is
    started again for the node, and the children of both report their own exit codes."""
    proc = _fresh(KEPT_THEN_REPLACED)
    assert proc.returncode == 0 and proc.stdout.split()[-1:] == ["ok"], proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("psarch: note:")]
    assert len(notes) == 1 and "TORCH_CPP_LOG_LEVEL unset, not TORCH_CPP_LOG_LEVEL=ERROR" in notes[0], proc.stderr


def test_the_forkserver_preloads_the_launchers_psarch_not_another_its_own_path_finds(tmp_path):
    """Python 3.11's forkserver ignores the sys.path multiprocessing hands it: where $PYTHONPATH named another
    psarch (a decoy here) and the launcher put its own first at run time, it preloaded the decoy's package beside
    the launcher's modules (the editable install's finder found those), and a child ran that mix. It imports from
    the launcher's sys.path (processes._import_path): a child holds the launcher's psarch, package and modules."""
    (tmp_path / "decoy" / "psarch").mkdir(parents=True)
    (tmp_path / "decoy" / "psarch" / "__init__.py").write_text("")
    (tmp_path / "report.py").write_text("import sys\n\ndef report():\n    m = sys.modules\n"
                                        "    print(m['psarch'].__file__, m['psarch.launch.ranks'].__file__)\n")
    root = TESTS.parent
    script = (f"import sys; sys.path.insert(0, {str(root)!r})\n"
              "import report\nfrom psarch.launch import processes\nctx = processes.context()\n"
              "p = processes.process(ctx, report.report, ())\np.start(); p.join(); sys.exit(p.exitcode)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path / "decoy")), timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(root / "psarch" / "__init__.py"), str(root / "psarch" / "launch" / "ranks.py")]
