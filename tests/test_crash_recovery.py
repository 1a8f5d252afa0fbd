"""Crash recovery: a run killed with SIGKILL between checkpoints, or while one is being written, resumes
(`--resume`) to the same model.pt as a run never interrupted, bit for bit, with every step's metrics once.

Kills as a user meets them: the launcher's whole process group (Ctrl-\\, `kill -9` of the session, a machine
going down) or one rank alone (the OOM killer's usual pick), after which the launcher stops its peers. A kill
in the middle of a checkpoint's write leaves the checkpoint before it the latest complete one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import checkpoint_runs as cr
from psarch import checkpoint
from psarch.cli import main

BACKENDS = {"single": {"kind": "single"}, "ddp": {"kind": "ddp", "world_size": 2},
            "zero3": {"kind": "zero", "stage": 3, "world_size": 2}}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """model.pt of each backend's uninterrupted run, made once when first asked for."""
    out, models = tmp_path_factory.mktemp("straight"), {}

    def model(backend: str) -> dict[str, torch.Tensor]:
        if backend not in models:
            cfg = cr.toml(out / f"{backend}.toml", cr.regression(backend, BACKENDS[backend]))
            assert main(["run", str(cfg), "--out", str(out / backend), "--quiet"]) == 0
            models[backend] = torch.load(out / backend / "model.pt", weights_only=True)
        return models[backend]
    return model


def _kill(cfg: Path, out: Path, marker: Path, world: int, victim: str, **hang: str) -> int:
    """Start `psarch run` with the hang `hang` names, wait until every rank stopped there, SIGKILL the
    victim ("group": the launcher's process group; "rank1": that rank alone); the launcher's exit code."""
    env = dict(os.environ, PSARCH_TEST_MARKER=str(marker), PYTHONPATH=os.pathsep.join(sys.path), **hang)
    proc = subprocess.Popen([sys.executable, "-m", "psarch.cli", "run", str(cfg), "--out", str(out), "--quiet"],
                            env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    markers = [Path(f"{marker}{r}") for r in range(world)]
    try:
        deadline = time.time() + 120
        while not all(m.exists() for m in markers):
            assert proc.poll() is None and time.time() < deadline, "the run ended before it reached the hang"
            time.sleep(0.1)
        if victim == "group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(int(markers[int(victim.removeprefix("rank"))].read_text()), signal.SIGKILL)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("backend, victim, hang, latest", [
    ("single", "group", {"PSARCH_TEST_HANG_AT": "5"}, 4),
    ("ddp", "group", {"PSARCH_TEST_HANG_AT": "5"}, 4),
    ("zero3", "rank1", {"PSARCH_TEST_HANG_AT": "5"}, 4),
    ("ddp", "group", {"PSARCH_TEST_HANG_IN_CHECKPOINT": "4"}, 2),   # killed while step 4's is written
])
def test_sigkill_then_resume_ends_with_the_same_model(tmp_path, straight, backend, victim, hang, latest):
    cfg = cr.toml(tmp_path / "run.toml", cr.regression(backend, BACKENDS[backend]))
    killed = tmp_path / "killed"
    code = _kill(cfg, killed, tmp_path / "hung", BACKENDS[backend].get("world_size", 1), victim, **hang)
    assert code != 0
    assert checkpoint.latest_complete(killed / "checkpoints").name == f"step_{latest:06d}"
    assert main(["run", str(cfg), "--resume", str(killed), "--quiet"]) == 0
    model = torch.load(killed / "model.pt", weights_only=True)
    reference = straight(backend)
    assert model.keys() == reference.keys() and all(torch.equal(model[k], reference[k]) for k in model)
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(8))
    assert not list((killed / "checkpoints").glob(".tmp_*"))   # the resumed run's next write cleared the leftover
