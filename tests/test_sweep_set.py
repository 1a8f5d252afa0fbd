"""`--set` on a key a sweep sets: the command line has the last word, as over the file. An axis is narrowed
to the --set value (its points keep their names, so finished ones are found again); an explicit point's value
is replaced. No process is started here."""
from __future__ import annotations

import json
from pathlib import Path

from psarch.config import from_dict
from psarch.launch.sweep import _why_run_again, expand, narrowed, read_sweep

MEMORY = Path(__file__).resolve().parent.parent / "experiments" / "scaling" / "memory_scaling.toml"


def test_set_narrows_a_sweep_axis_to_its_value():
    full = {p.name for p in expand(MEMORY, read_sweep(MEMORY))}
    points = expand(MEMORY, read_sweep(MEMORY), ["backend.world_size=2"])
    assert [p.overrides["backend.world_size"] for p in points] == [2, 2, 2, 2]
    assert [p.name for p in points] == ["ddp-world_size2", "zero-stage1-world_size2", "zero-stage2-world_size2",
                                        "zero-stage3-world_size2"]
    assert {p.name for p in points} <= full   # the same folders as the whole sweep's points
    assert narrowed(read_sweep(MEMORY), ["backend.world_size=2"])[1] == [
        "--set backend.world_size=2 narrows the sweep axis backend.world_size = [1, 2, 4, 8] to [2]"]


def test_set_replaces_a_value_that_explicit_points_set(tmp_path):
    (tmp_path / "sw.toml").write_text('[train]\nglobal_batch = 4\n[sweep]\npoints = [{ backend = "single" }, '
                                      '{ backend = "ddp", "backend.world_size" = 2 }]\n')
    sweep = read_sweep(tmp_path / "sw.toml")
    points = expand(tmp_path / "sw.toml", sweep, ['backend.kind="ddp"', "backend.world_size=2"])
    assert [p.overrides for p in points] == [{"backend.kind": "ddp"}, {"backend.kind": "ddp", "backend.world_size": 2}]
    assert narrowed(sweep, ['backend.kind="ddp"'])[1] == [
        '--set backend.kind="ddp" replaces backend.kind in every sweep point that sets it']


def test_a_report_only_key_runs_no_point_again(tmp_path):
    """convergence_target changes how compare reads a run, not the run: a finished point is kept; a change of
    what a step computes runs it again."""
    cfg = from_dict({"train": {"steps": 4}})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "finished"}))
    assert _why_run_again(tmp_path, from_dict({"train": {"steps": 4}, "convergence_target": 0.3})) is None
    assert "train.steps" in _why_run_again(tmp_path, from_dict({"train": {"steps": 5}}))
