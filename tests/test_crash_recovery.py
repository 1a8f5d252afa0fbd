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
from timing import scaled

BACKENDS = {"single": {"kind": "single"}, "ddp": {"kind": "ddp", "world_size": 2},
            "zero3": {"kind": "zero", "stage": 3, "world_size": 2},
            "ps": {"kind": "ps", "world_size": 2, "mode": "sync"}}


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


def _start(cfg: Path, out: Path, marker: Path, *args: str, **hang: str) -> subprocess.Popen:
    env = dict(os.environ, PSARCH_TEST_MARKER=str(marker), PYTHONPATH=os.pathsep.join(sys.path), **hang)
    return subprocess.Popen([sys.executable, "-m", "psarch.cli", "run", str(cfg), "--out", str(out), "--quiet", *args],
                            env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)


def _kill(cfg: Path, out: Path, marker: Path, world: int, victim: str, **hang: str) -> int:
    """Start `psarch run` with the hang `hang` names, wait until every rank (a PS server hang: every server)
    stopped there, SIGKILL the victim ("group": the launcher's process group; "rank1": that rank alone); the
    launcher's exit code."""
    proc = _start(cfg, out, marker, **hang)
    stopped = (["s0"] if "PSARCH_TEST_HANG_SERVER_IN_CHECKPOINT" in hang
               else [str(r) for r in range(world)])
    markers = [Path(f"{marker}{r}") for r in stopped]
    try:
        deadline = time.time() + scaled(120)
        while not all(m.exists() for m in markers):
            assert proc.poll() is None and time.time() < deadline, "the run ended before it reached the hang"
            time.sleep(0.1)
        if victim == "group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(int(markers[int(victim.removeprefix("rank"))].read_text()), signal.SIGKILL)
        proc.communicate(timeout=scaled(60))
        return proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("backend, victim, hang, latest", [
    ("single", "group", {"PSARCH_TEST_HANG_AT": "5"}, 4),
    ("ddp", "group", {"PSARCH_TEST_HANG_AT": "5"}, 4),
    ("zero3", "rank1", {"PSARCH_TEST_HANG_AT": "5"}, 4),
    ("ddp", "group", {"PSARCH_TEST_HANG_IN_CHECKPOINT": "4"}, 2),   # killed while step 4's is written
    ("ps", "group", {"PSARCH_TEST_HANG_IN_CHECKPOINT": "4"}, 2),    # workers' parts written, no server's yet
    ("ps", "group", {"PSARCH_TEST_HANG_SERVER_IN_CHECKPOINT": "4"}, 2),   # every part written, not yet merged
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


def test_a_ps_save_that_times_out_fails_the_run_then_resumes_to_the_same_model(tmp_path, straight):
    """A PS server that stalls while it writes its part of checkpoint 4 never acks the workers' `save`: after
    backend.timeout_s (+ 5 s) the run fails, naming the checkpoint and the server, and leaves checkpoint 2 the
    latest complete one; --resume (timeout_s may change) ends with the uninterrupted run's model."""
    cfg = cr.toml(tmp_path / "run.toml", cr.regression("ps", BACKENDS["ps"]))
    out = tmp_path / "stalled"
    proc = _start(cfg, out, tmp_path / "hung", "--set", "backend.timeout_s=2",
                  PSARCH_TEST_HANG_SERVER_IN_CHECKPOINT="4")
    try:
        _, err = proc.communicate(timeout=scaled(120))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err
    assert "checkpoint step 4 not written: worker " in err and "no reply from server" in err, err
    assert checkpoint.latest_complete(out / "checkpoints").name == "step_000002"
    assert main(["run", str(cfg), "--resume", str(out), "--quiet"]) == 0
    model, reference = torch.load(out / "model.pt", weights_only=True), straight("ps")
    assert model.keys() == reference.keys() and all(torch.equal(model[k], reference[k]) for k in model)
