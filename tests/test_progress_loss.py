"""Every backend's progress line shows the same loss: the mean over the ranks of the steps since the last line,
the quantity metrics.jsonl records. The PS in sync has no process group to average through; bit-identical
models once printed different losses (rank 0's against DDP's mean), and the PS looked worse."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

import pytest
from timing import scaled
from tiny import tiny

TINY = tiny(global_batch=8, rest="[backend]\nworld_size = 2")
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                         "PSARCH_DEBUG")}
ENV["PSARCH_THREADS"] = "1"
LOSS = re.compile(r"^step\s+(\d+)/\d+\s+\d+-step mean loss\s+(\d+\.\d{4})", re.M)


def _progress(tmp_path, name: str, *sets: str) -> tuple[dict[int, float], list[dict]]:
    """(step -> the loss its progress line printed, the run's metrics.jsonl rows)."""
    (tmp_path / "tiny.toml").write_text(TINY)
    args = [sys.executable, "-m", "psarch.cli", "run", "tiny.toml", "--out", name]
    proc = subprocess.run(args + [a for s in sets for a in ("--set", s)], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=scaled(180))
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return {int(s): float(v) for s, v in LOSS.findall(proc.stdout)}, rows


def test_ps_sync_and_ddp_print_the_same_loss_the_mean_over_ranks(tmp_path):
    ps, ps_rows = _progress(tmp_path, "ps", 'backend.kind="ps"', 'backend.mode="sync"')
    ddp, _ = _progress(tmp_path, "ddp", 'backend.kind="ddp"')
    assert sorted(ps) == sorted(ddp) == [2, 4, 6]
    # the same models (parity to ~1e-7): the same printed loss, to one unit in the 4th decimal at most
    for step in ps:
        assert ps[step] == pytest.approx(ddp[step], abs=1.5e-4), (step, ps, ddp)
    # and it is metrics.jsonl's loss (each step's mean over the ranks), averaged over the line's steps
    for step, printed in ps.items():
        assert printed == pytest.approx(statistics.fmean(r["loss"] for r in ps_rows[step - 2:step]), abs=6e-5)
