"""Every wait of the launcher is bounded (issue 35): a worker stopped by SIGSTOP once its peers are done is killed
after 2 x backend.timeout_s + 5 s and named; a run whose every worker is lost still writes its summary and metrics."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

import psarch
from psarch.config import from_dict
from psarch.errors import RunError
from ps_setup import config, ps
from test_ps_faults import _children, _with_batch_hook

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc (Linux)")


def stops_on_rank1_at_step3(cfg) -> psarch.Workload:
    """Rank 1 stops itself (SIGSTOP) when it fetches the batch of step 3: alive, silent, never ending."""
    return _with_batch_hook(cfg, lambda step, shard: os.kill(os.getpid(), signal.SIGSTOP)
                            if (shard, step) == (1, 3) else None)


def dies_on_every_rank_at_step3(cfg) -> psarch.Workload:
    return _with_batch_hook(cfg, lambda step, shard: os._exit(3) if step == 3 else None)


def _run(out: Path, name: str, factory: str, backend: dict) -> dict:
    cfg = from_dict(config(name, workload={"factory": f"test_stalled_ranks:{factory}"},
                           train={"optimizer": "sgd", "lr": 0.1, "steps": 8}, backend=backend))
    try:
        return psarch.run(cfg, out, echo=False)
    finally:
        assert _children() == [], "processes left running after the run"


def test_a_stopped_async_worker_is_killed_after_timeout_and_counted_lost(tmp_path, capfd):
    out = tmp_path / "stopped"
    summary = _run(out, "stopped", "stops_on_rank1_at_step3", ps(2, "async", timeout_s=2.0))
    assert [w["rank"] for w in summary["lost_workers"]] == [1]
    assert "was stopped (SIGSTOP?) and made no progress for 9 s (2 x backend.timeout_s = 2 s + 5)" in \
        summary["lost_workers"][0]["error"]
    assert "psarch: rank 1 killed: Stalled:" in capfd.readouterr().err
    assert summary["status"] == "finished" and summary["steps"] == 8
    assert json.loads((out / "summary.json").read_text())["lost_workers"] == summary["lost_workers"]


def test_a_stopped_ddp_rank_is_named_as_the_cause(tmp_path):
    with pytest.raises(RunError, match=r"rank 1 \(pid \d+\) is stopped \(SIGSTOP\?\); its peers failed waiting"):
        _run(tmp_path / "ddp", "ddp", "stops_on_rank1_at_step3", {"kind": "ddp", "world_size": 2, "timeout_s": 2.0})
    assert json.loads((tmp_path / "ddp" / "summary.json").read_text())["status"] == "failed"


def test_a_run_whose_every_worker_is_lost_writes_its_summary_and_metrics(tmp_path):
    out = tmp_path / "all-lost"
    with pytest.raises(RunError, match=r"every worker was lost: rank [01] exited with code 3"):
        _run(out, "all-lost", "dies_on_every_rank_at_step3", ps(2, "async", timeout_s=30.0))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("every worker was lost")
    assert sorted(w["rank"] for w in summary["lost_workers"]) == [0, 1]
    assert summary["steps"] == 3 and summary["traffic"]["servers"][0]["received"] > 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert (out / "model.pt").is_file()
