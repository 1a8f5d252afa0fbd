"""Teardown (issue 20): a process that held a gloo group and has written everything leaves with os._exit, so
gloo's threads never meet the interpreter's finalisation, where they can abort a finished process (torch 2.13,
pytorch/pytorch#179291); a process that really died is named by its signal, never by a guess.
tests/stress_teardown.py repeats the two-rank teardowns by the hundred; the suite runs a few."""
from __future__ import annotations

import atexit
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import RankError, run_ranks
from psarch.launch import processes, supervise
from psarch.config import load_config
from psarch.errors import RunError
from psarch.launch.ranks import run
from stress_teardown import BACKENDS, TINY, stress
from timing import scaled


def _no_core() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # an abort here writes no core file


def _aborts_if_finalised(rank: int, world_size: int, marker: str) -> dict:
    """Report, having armed what finalisation would run: a mark, then an abort (as gloo's threads can)."""
    def finalised() -> None:
        Path(f"{marker}{rank}").write_text("finalised\n")
        _no_core()
        os.abort()
    atexit.register(finalised)
    return {"rank": rank}


def _aborts(rank: int, world_size: int) -> None:
    _no_core()
    os.kill(os.getpid(), signal.SIGABRT)


@pytest.fixture(params=["forkserver", "spawn"])
def started(request, monkeypatch):
    """How psarch starts a child: forked from its forkserver (where multiprocessing ends the child with os._exit
    too), or spawned (an emulated cluster's, where the forkserver cannot serve its nodes:
    psarch.launch.processes.serves), where only psarch's own leave() keeps finalisation away."""
    if request.param == "spawn":
        monkeypatch.setattr(processes, "context", processes.spawn)
    return request.param


@pytest.mark.slow
def test_run_ranks_keeps_the_results_and_its_ranks_leave_without_finalisation(tmp_path, started):
    marker = str(tmp_path / "finalised")
    assert run_ranks(_aborts_if_finalised, 2, marker, timeout=scaled(60)) == [{"rank": 0}, {"rank": 1}]
    assert not list(tmp_path.glob("finalised*")), "a rank went through the interpreter's finalisation"


@pytest.mark.slow
def test_run_ranks_names_the_signal_of_a_rank_that_died_before_reporting():
    with pytest.raises(RankError, match=r"rank 0 was killed by SIGABRT without reporting; see its stderr"):
        run_ranks(_aborts, 1, timeout=scaled(60))


def _ended_by(code: str) -> int:
    """The exit code of a Python process that runs `code` (writing no core file)."""
    no_core = "import resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
    return subprocess.run([sys.executable, "-c", no_core + code], timeout=scaled(60), check=False).returncode


@pytest.mark.parametrize("code,says", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGABRT)", "was killed by SIGABRT before it could report"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
     "was killed by SIGKILL (SIGKILL: the kernel's out-of-memory killer sends it, as does `kill -9`) before"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "was killed by SIGSEGV before it could report"),
    ("raise SystemExit(3)", "exited with code 3 before it could report an error"),
])
def test_a_rank_that_left_no_record_is_named_by_how_it_ended(tmp_path, code, says):
    (tmp_path / "ranks").mkdir()
    message = supervise.rank_error(tmp_path, 1, _ended_by(code))
    assert message.startswith(f"rank 1 {says}"), message
    assert ("out-of-memory" in message) == ("SIGKILL" in code), message   # named only where it can be the cause


@pytest.mark.slow
def test_spawned_ranks_leave_without_finalisation(tmp_path, started):
    """Ranks that would abort at finalisation (factories:aborts_if_finalised) finish their run: psarch's
    ranks, forked or spawned, end with os._exit once their records are written."""
    cfg = load_config(None, dict(TINY, **{"backend.kind": "ddp", "workload.factory": "factories:aborts_if_finalised"}))
    summary = run(cfg, tmp_path / "out", echo=False)
    assert summary["status"] == "finished" and len(summary["memory"]["per_rank"]) == 2


@pytest.mark.slow
def test_torchrun_ranks_leave_without_finalisation(tmp_path):
    """The same under torchrun: each rank's `psarch run` ends with os._exit once the run is written."""
    keys = dict(TINY, **{"backend.kind": "ddp", "workload.factory": "factories:aborts_if_finalised"})
    (tmp_path / "tiny.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PSARCH_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                         "127.0.0.1", "--master_port", str(port), "-m", "psarch.cli", "run", "tiny.toml", "--out",
                         "out", "--quiet"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(180),
                        check=False)
    assert tr.returncode == 0, tr.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_a_rank_killed_by_sigabrt_fails_the_run_with_the_signals_name(tmp_path):
    cfg = load_config(None, dict(TINY, **{"backend.kind": "ddp", "workload.factory":
                                          "factories:aborts_last_shard_at_last_step"}))
    with pytest.raises(RunError, match=r"^rank 1 was killed by SIGABRT before it could report an error$"):
        run(cfg, tmp_path / "out", echo=False)


@pytest.mark.stress
@pytest.mark.slow
def test_two_rank_runs_of_every_collective_backend_end_without_an_abort(tmp_path):
    """Two runs per backend: ten two-rank teardowns, every rank started and leaving as `psarch run`'s do (every
    other multi-process test's ranks leave the same way, hundreds in the suite); tests/stress_teardown.py runs
    hundreds of these alone."""
    tallies = [stress(b, 2, tmp_path) for b in BACKENDS]
    assert [(t.backend, t.finished, t.aborted, t.failures) for t in tallies] == [(b, 2, 0, []) for b in BACKENDS]
