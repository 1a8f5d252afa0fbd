"""A run's life: the failing rank named over its peers' echoes, SIGTERM handled as Ctrl-C with the finished
steps kept, and no child (rank or parameter server) outliving a launcher that is SIGTERMed or SIGKILLed.

Launchers are `python -m psarch.cli run` subprocesses on loopback; every wait is bounded."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import alive, descendants
from psarch.launch import supervise
from psarch.errors import NON_FINITE_EXIT
from timing import scaled

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG (Linux)")

TINY = """
[workload.gpt]
n_layer = 1
n_embd = 16
n_head = 2
[workload.markov]
vocab_size = 16
[train]
steps = 100000
global_batch = 4
log_every = 1000
"""
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                          "PSARCH_DEBUG")}
ENV["PSARCH_THREADS"] = "1"


def write_error(ranks: Path, rank: int, error: str, at_ns: int) -> None:
    (ranks / f"rank{rank}.error").write_text(json.dumps({"rank": rank, "error": error, "failed_at_ns": at_ns,
                                                          "traceback": ""}))


def test_root_cause_is_the_error_not_a_peers_echo_of_it(tmp_path):
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    # the same clock tick (what file mtimes gave on a fast machine), and even an echo recorded first
    write_error(ranks, 0, "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection reset by peer", 100)
    write_error(ranks, 1, "RuntimeError: injected failure at step 2", 100)
    assert supervise.root_cause(tmp_path, {0: 1, 1: 1}) == 1
    write_error(ranks, 1, "RuntimeError: injected failure at step 2", 200)
    assert supervise.root_cause(tmp_path, {0: 1, 1: 1}) == 1
    # two causes: the earlier; a rank that left no record (killed) before any; a non-finite loss before all
    write_error(ranks, 2, "ValueError: bad batch", 150)
    assert supervise.root_cause(tmp_path, {0: 1, 1: 1, 2: 1}) == 2
    assert supervise.root_cause(tmp_path, {0: 1, 1: 1, 2: 1, 3: -9}) == 3
    write_error(ranks, 4, "NonFiniteLoss: loss is nan at step 3 on worker 4", 300)
    assert supervise.root_cause(tmp_path, {0: 1, 1: 1, 2: 1, 3: -9, 4: NON_FINITE_EXIT}) == 4


def start(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    (tmp_path / "tiny.toml").write_text(TINY)
    args = [sys.executable, "-m", "psarch.cli", "run", "tiny.toml", "--out", "out", "--quiet"]
    for o in overrides:
        args += ["--set", o]
    return subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def training(tmp_path: Path, proc: subprocess.Popen, ranks: int, steps: int = 3, limit: float = 90) -> set[int]:
    """Wait until every rank has streamed `steps` rows; the launcher's descendants then."""
    deadline = time.monotonic() + scaled(limit)
    streams = [tmp_path / "out" / "ranks" / f"rank{r}.jsonl" for r in range(ranks)]
    while not all(p.is_file() and p.read_text().count("\n") >= steps for p in streams):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run did not start training: {proc.communicate()[1][-2000:]}")
        time.sleep(0.1)
    return descendants(proc.pid)


def assert_all_gone(pids: set[int], limit: float = 15) -> None:
    deadline = time.monotonic() + scaled(limit)
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = sorted(p for p in pids if alive(p))
    for p in left:  # only what this test started
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes outlived their launcher: {left}"


def test_sigterm_stops_the_run_as_ctrl_c_does_and_keeps_the_finished_steps(tmp_path):
    proc = start(tmp_path, "backend.kind=ddp", "backend.world_size=2")
    kids = training(tmp_path, proc, ranks=2)
    assert len(kids) >= 2
    proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=scaled(30))
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted (stopped by SIGTERM)" in stderr, stderr
    assert_all_gone(kids)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert summary["status"] == "interrupted" and summary["steps"] >= 3 and len(rows) == summary["steps"], summary
    assert summary["error"] == "Terminated: stopped by SIGTERM"


def test_sigkill_of_the_launcher_leaves_no_rank_or_server_running(tmp_path):
    proc = start(tmp_path, "backend.kind=ps", "backend.world_size=2", "backend.mode=async")
    kids = training(tmp_path, proc, ranks=2)
    assert len(kids) >= 3   # two workers and a parameter server (and multiprocessing's resource tracker)
    proc.kill()             # SIGKILL: nothing in the launcher runs; the kernel must end the children
    proc.communicate(timeout=scaled(10))
    assert_all_gone(kids)


def test_stop_passes_over_ranks_that_never_started():
    """A start that fails part-way leaves the later ranks unstarted: stopping the run must not replace the
    start's error with its own (join refuses a process that never started)."""
    ctx = mp.get_context("spawn")
    started, unstarted = ctx.Process(target=time.sleep, args=(60,)), ctx.Process(target=time.sleep, args=(60,))
    started.start()
    supervise.stop([started, unstarted])
    assert started.exitcode == -signal.SIGTERM and unstarted.exitcode is None
