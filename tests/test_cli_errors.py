"""End to end, what stops `python -m psarch.cli run`: config errors (exit 2 before anything starts), a failing rank
(the run stops with its error, nothing left running) and an unforeseen error (one line; a traceback with
PSARCH_DEBUG=1). Every run is a subprocess, as in tests/test_cli.py, but the config errors and the unforeseen error:
`psarch run` in this process (in_process.py: an interpreter and torch's import a call saved), as a bare command line
would run it, and one missing file as a command (its exit code and its one line from a process of its own)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from factories import FAILING_FACTORY
from in_process import psarch_cli
from procs import alive, descendants
from test_cli import CWD_FACTORY, ENV, TINY, cli_args, psarch
from timing import scaled


# ---------------------------------------------------------------- (c) config errors

@pytest.fixture
def bare_cli(tmp_path, capsys, monkeypatch):
    """`psarch ARGS` in this process, in tmp_path, with the environment test_cli.ENV gives a command: (exit code,
    stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    for k in set(os.environ) - set(ENV):
        monkeypatch.delenv(k)
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    return lambda *args: psarch_cli(capsys, *args)


@pytest.mark.parametrize("overrides, key", [
    (["train.stepz=5"], "train.stepz"),                                       # unknown key
    (["train.steps=0"], "train.steps"),                                       # bad value
    (['train.steps="5"'], "train.steps"),                                     # wrong type
    (["name=../../x"], "name"),                                               # a run folder outside runs/
    (["name=/tmp/psarch-x"], "name"),
    (["workload.markov.vocab_size=100000"], "workload.markov.vocab_size"),    # the chain would not fit
    (["workload.data=text", "workload.text.path=absent.txt"], "workload.text.path"),
    (["workload.data=text", "workload.text.path=short.txt"], "workload.text.path"),  # 5 bytes < seq_len + 1
    pytest.param(["backend.device=cuda"], "backend.device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only machine")),
    pytest.param(["backend.kind=ddp", "backend.world_size=2", "backend.dist_backend=nccl"], "backend.dist_backend",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only machine")),
    (["backend.kind=ddp", "backend.world_size=3"], "train.global_batch"),     # 4 samples over 3 workers
])
def test_config_error_exits_2_before_anything_starts(tmp_path, bare_cli, overrides, key):
    (tmp_path / "tiny.toml").write_text(TINY)
    (tmp_path / "short.txt").write_text("12345")
    args = ["run", "tiny.toml", "--out", "out/x"]
    for o in overrides:
        args += ["--set", o]
    code, out, err = bare_cli(*args)
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert key in lines[0] and "config error" in lines[0]
    assert out == ""
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text, what", [
    (TINY.replace("seed = 1", "seed = 1 # caf\xe9").encode("latin-1"), "not UTF-8"),
    (b"sweep = 3\n" + TINY.encode(), "sweep = 3"),
    (TINY.encode() + b'[[sweep]]\nbackend = ["single"]\n', "sweep = ["),
    # one bad point stops the sweep before any point runs
    (TINY.encode() + b'[sweep]\n"train.steps" = [2, 0]\n', "sweep point steps0: train.steps = 0"),
])
def test_bad_config_file_exits_2_before_anything_starts(tmp_path, bare_cli, text, what):
    (tmp_path / "tiny.toml").write_bytes(text)
    code, out, err = bare_cli("run", "tiny.toml")
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("psarch: config error: ") and what in lines[0], err
    assert out == "" and not (tmp_path / "runs").exists()


def test_missing_config_file_exits_2(tmp_path):
    proc = psarch(tmp_path, "run", "absent.toml", timeout=scaled(60))
    assert proc.returncode == 2
    assert "absent.toml" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- (d) a failing rank



@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process table read from /proc (Linux)")
def test_failing_rank_stops_the_run_with_its_error(tmp_path):
    (tmp_path / "failing_factory.py").write_text(FAILING_FACTORY)
    (tmp_path / "tiny.toml").write_text(TINY)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    env = dict(ENV, PSARCH_TEST_PIDDIR=str(piddir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), ENV.get("PYTHONPATH")])))
    args = cli_args("run", "tiny.toml", "--out", "out/fail", "--set", "workload.factory=failing_factory:make",
                    "--set", "backend.kind=ddp", "--set", "backend.world_size=2",
                    "--set", "train.optimizer=sgd", "--set", "train.lr=0.01",
                    # far longer than the test allows: only the launcher stopping the run makes it end in time
                    "--set", "backend.timeout_s=600")
    limit = min(scaled(60), 300)   # the machine's load stretches it, never to the timeout it must not wait for
    t0 = time.monotonic()
    with open(tmp_path / "stdout.txt", "w") as out, open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=out, stderr=err)
        seen: set[int] = set()
        try:
            while proc.poll() is None:
                seen |= descendants(proc.pid)
                if time.monotonic() - t0 > limit + 30:
                    raise AssertionError(f"psarch run did not stop within {limit + 30:.0f} s after a rank failed "
                                         "(hang)")
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                for pid in descendants(proc.pid):  # only what this test started
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                proc.kill()
            proc.wait()
    elapsed = time.monotonic() - t0
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 1, (proc.returncode, stderr)
    assert elapsed < limit, f"took {elapsed:.1f} s (limit {limit:.0f} s at this load)"
    # one headline naming the failing rank and its error (then that rank's traceback); the CLI itself does not crash
    first = [line for line in stderr.splitlines() if not line.startswith("psarch: note:")][0]
    assert first == "psarch: run 'tiny' failed: rank 1 failed: RuntimeError: injected failure at step 2", stderr
    assert "psarch/cli.py" not in stderr and "cli.py\"" not in stderr, stderr
    # the rank that failed left its error; rank 0 got through the steps before the failure
    assert "injected failure" in (tmp_path / "out" / "fail" / "ranks" / "rank1.error").read_text()
    # the failed run keeps the steps both ranks finished (0 and 1) and says why it stopped
    summary = json.loads((tmp_path / "out" / "fail" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 2, summary
    assert summary["error"] == "rank 1 failed: RuntimeError: injected failure at step 2", summary
    metrics = [json.loads(line) for line in (tmp_path / "out" / "fail" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1] and all(len(m["workers"]) == 2 for m in metrics), metrics

    # nothing left running: every rank (their pids written by the factory) and every process the CLI started
    rank_pids = {int(p.name) for p in piddir.iterdir()} - {proc.pid}  # the launcher checks the factory once
    assert len(rank_pids) == 2, rank_pids
    assert rank_pids <= seen, "the ranks were not children of the CLI?"
    deadline = time.monotonic() + scaled(10)
    while time.monotonic() < deadline and any(alive(p) for p in seen | rank_pids):
        time.sleep(0.1)
    left = sorted(p for p in seen | rank_pids if alive(p))
    assert not left, f"processes left running after the run failed: {left}"


# ---------------------------------------------------------------- unforeseen errors

def test_unforeseen_error_is_one_line_and_a_traceback_with_psarch_debug(tmp_path, bare_cli, monkeypatch):
    """As the command runs it, in this process: one line; with PSARCH_DEBUG=1 the error leaves main(), which the
    interpreter then prints with its traceback."""
    (tmp_path / "my_cwd_factory.py").write_text(CWD_FACTORY)
    (tmp_path / "tiny.toml").write_text(TINY)
    monkeypatch.setattr(sys, "path", list(sys.path))   # the launcher adds the working folder to find the factory
    args = ["run", "tiny.toml", "--quiet", "--set", "workload.factory=my_cwd_factory:broken"]
    try:
        code, _, err = bare_cli(*args)
        assert code == 1, err
        assert [line for line in err.strip().splitlines() if not line.startswith("psarch: note:")] == [
            "psarch: run failed: KeyError: 'no such key' (PSARCH_DEBUG=1 shows the traceback)"], err
        monkeypatch.setenv("PSARCH_DEBUG", "1")
        with pytest.raises(KeyError, match="no such key"):
            bare_cli(*args)
    finally:
        sys.modules.pop("my_cwd_factory", None)   # another test's folder may hold a module of that name
