"""Launch: the same config under `psarch run` (spawned ranks) and under torchrun gives the same model."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from factories import FAILING_FACTORY
from in_process import psarch_cli
from timing import scaled

TINY = """
name = "tiny"
seed = 5
[workload]
seq_len = 8
[workload.gpt]
n_layer = 1
n_embd = 16
n_head = 2
[train]
steps = 4
global_batch = 4
log_every = 2
[backend]
kind = "ddp"
world_size = 2
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def local(tmp_path, capsys, monkeypatch):
    """`psarch run CONFIG --out local` in tmp_path, in this process (in_process.py: an interpreter and torch's
    import saved; its ranks are started as a command's are, from psarch's forkserver), one thread per rank as under torchrun below."""
    def run(config: str) -> None:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("PSARCH_THREADS", "1")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        code, _, err = psarch_cli(capsys, "run", config, "--out", "local")
        assert code == 0, err
    return run


def test_torchrun_matches_local_launch(tmp_path, local):
    (tmp_path / "tiny.toml").write_text(TINY)
    local("tiny.toml")
    env = dict(os.environ, PSARCH_THREADS="1", OMP_NUM_THREADS="1")
    tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                         "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                         "-m", "psarch.cli", "run", "tiny.toml", "--out", "torchrun"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(120))
    assert tr.returncode == 0, tr.stderr[-3000:]
    a = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "torchrun" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:  # same algorithm, same data, same reduction order: bit for bit
        assert torch.equal(a[k], b[k]), k
    s = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert s["world_size"] == 2 and len(s["traffic"]["per_rank"]) == 2 and s["steps"] == 4


def test_torchrun_world_size_mismatch_is_an_error(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY.replace("world_size = 2", "world_size = 4"))
    env = dict(os.environ, PSARCH_THREADS="1", OMP_NUM_THREADS="1")
    tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                         "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                         "-m", "psarch.cli", "run", "tiny.toml", "--out", "x"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(120))
    assert tr.returncode != 0
    assert "backend.world_size = 4" in tr.stderr and "WORLD_SIZE = 2" in tr.stderr


def torchrun(tmp_path, *args, timeout=None, env_extra=None):
    env = dict(os.environ, PSARCH_THREADS="1", OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           "-m", "psarch.cli", "run", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout or scaled(180))


def test_torchrun_ps_rank0_starts_the_servers_and_matches_the_local_launch(tmp_path, local):
    """kind = "ps" with no backend.server_addresses: under torchrun rank 0 starts the servers (and is
    worker 0); every rank learns their addresses over the process group. Sync PS with 2 workers sums
    two gradients (commutative), so both launches end with the same model bit for bit."""
    (tmp_path / "ps.toml").write_text(TINY.replace('kind = "ddp"', 'kind = "ps"\nmode = "sync"\nservers = 2'))
    local("ps.toml")
    tr = torchrun(tmp_path, "ps.toml", "--out", "torchrun")
    assert tr.returncode == 0, tr.stderr[-3000:]
    a = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "torchrun" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    s = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert s["backend"] == "ps" and s["steps"] == 4 and len(s["traffic"]["per_rank"]) == 2
    servers = s["traffic"]["servers"]   # the servers' own measurements reached the summary
    assert [x["server"] for x in servers] == [0, 1]
    assert sum(x["received"] for x in servers) == sum(r["sent"] for r in s["traffic"]["per_rank"])


def test_torchrun_failing_rank_reports_its_error_without_waiting_for_the_timeout(tmp_path):
    """Rank 1 raises at step 2 while rank 0 waits in that step's all-reduce: rank 1 prints its error and
    exits at once (no teardown barrier, whose timeout would replace the error), torchrun stops rank 0."""

    (tmp_path / "failing_factory.py").write_text(FAILING_FACTORY)
    (tmp_path / "tiny.toml").write_text(TINY.replace("world_size = 2", "world_size = 2\ntimeout_s = 600.0"))
    limit = min(scaled(40), 300)   # the machine's load stretches it, never to the timeout it must not wait for
    t0 = time.monotonic()
    tr = torchrun(tmp_path, "tiny.toml", "--out", "fail", "--set", "workload.factory=failing_factory:make",
                  env_extra={"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    elapsed = time.monotonic() - t0
    assert tr.returncode != 0
    assert "rank 1 failed: RuntimeError: injected failure at step 2" in tr.stderr, tr.stderr[-3000:]
    assert elapsed < limit, f"took {elapsed:.0f} s (limit {limit:.0f} s): the failure waited for backend.timeout_s"
    # rank 0, stopped in step 2's all-reduce, keeps the steps every rank finished, as `psarch run` does
    s = json.loads((tmp_path / "fail" / "summary.json").read_text())
    assert s["status"] in ("failed", "interrupted") and s["steps"] == 2, s
