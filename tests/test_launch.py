"""Launch: the same config under `psarch run` (spawned ranks) and under torchrun gives the same model."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch

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


def test_torchrun_matches_local_launch(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    env = dict(os.environ, PSARCH_THREADS="1", OMP_NUM_THREADS="1")
    local = subprocess.run([sys.executable, "-m", "psarch.cli", "run", "tiny.toml", "--out", "local"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert local.returncode == 0, local.stderr
    tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                         "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                         "-m", "psarch.cli", "run", "tiny.toml", "--out", "torchrun"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
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
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert tr.returncode != 0
    assert "backend.world_size = 4" in tr.stderr and "WORLD_SIZE = 2" in tr.stderr
