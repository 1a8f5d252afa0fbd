"""A sweep's own options: its axes must be lists, a single run's flags (--overwrite, --resume) are refused, and
--from forks the checkpoint at every point. The sweep's runs and their report: tests/test_compare.py."""
from __future__ import annotations

import json

import pytest

from psarch.launch.sweep import expand, read_sweep
from test_compare import SWEEP, TINY


def test_sweep_axes_must_be_lists(tmp_path):
    (tmp_path / "bad.toml").write_text(TINY + '[sweep]\n"backend.world_size" = 2\n')
    with pytest.raises(Exception, match="sweep.backend.world_size = 2: expected a non-empty list"):
        expand(tmp_path / "bad.toml", read_sweep(tmp_path / "bad.toml"))


@pytest.mark.parametrize("flag", [["--overwrite"], ["--resume", "x"]])
def test_a_sweep_refuses_single_run_flags(tmp_path, capsys, flag):
    from psarch.cli import main

    (tmp_path / "sw.toml").write_text(TINY + SWEEP)
    assert main(["run", str(tmp_path / "sw.toml"), "--out", str(tmp_path / "out"), "--quiet", *flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"is a sweep: {flag[0]} applies to one run only" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_sweep_given_from_forks_that_checkpoint_at_every_point(tmp_path, capsys):
    """Every point starts at the checkpoint's step (its metrics begin there); a missing one is one line."""
    from psarch.cli import main

    (tmp_path / "trunk.toml").write_text(TINY.replace('"sw"', '"trunk"') + "checkpoint_every = 2\n")
    assert main(["run", str(tmp_path / "trunk.toml"), "--out", str(tmp_path / "trunk"), "--quiet",
                 "--set", "train.steps=2"]) == 0
    (tmp_path / "fork.toml").write_text(TINY + '[sweep]\n"train.lr" = [0.01, 0.02]\n')
    ckpt = tmp_path / "trunk" / "checkpoints" / "step_000002"
    assert main(["run", str(tmp_path / "fork.toml"), "--out", str(tmp_path / "fork"), "--quiet",
                 "--from", str(ckpt)]) == 0
    for point in ("lr0.01", "lr0.02"):
        rows = [json.loads(line) for line in (tmp_path / "fork" / point / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [2, 3], point
    capsys.readouterr()
    assert main(["run", str(tmp_path / "fork.toml"), "--out", str(tmp_path / "fork2"), "--quiet",
                 "--from", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--from" in err[0] and "nowhere" in err[0], err
