"""A finished run is never silently replaced: `psarch run` refuses an occupied folder without --overwrite,
and a sweep skips a point only when its folder holds a finished run of exactly the point's config.

No processes: the checks happen before anything runs."""
from __future__ import annotations

import json

from psarch.cli import main
from psarch.config import load_config
from psarch.launch.sweep import _why_run_again

TINY = '[train]\nsteps = 4\nglobal_batch = 4\n'


def test_run_refuses_a_folder_that_holds_a_finished_run(tmp_path, capsys):
    (tmp_path / "tiny.toml").write_text(TINY)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "summary.json").write_text('{"status": "finished"}')
    assert main(["run", str(tmp_path / "tiny.toml"), "--out", str(folder), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"psarch: {folder} already holds a finished run; pass --overwrite to replace it, or choose another "
                   f"folder with --out"], err
    assert (folder / "summary.json").read_text() == '{"status": "finished"}'   # untouched


def test_sweep_point_runs_again_unless_its_finished_config_is_the_same(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    cfg = load_config(tmp_path / "tiny.toml")
    folder = tmp_path / "point"
    assert _why_run_again(folder, cfg) == "no run yet"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    (folder / "summary.json").write_text('{"status": "finished"}')
    assert _why_run_again(folder, cfg) is None
    changed = load_config(tmp_path / "tiny.toml", ["train.steps=50"])
    assert _why_run_again(folder, changed) == "its config changed: train.steps = 4 -> 50"
    (folder / "summary.json").write_text('{"status": "failed", "error": "rank 1 failed"}')
    assert _why_run_again(folder, cfg) == "the last run failed"
