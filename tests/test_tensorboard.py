"""train.tensorboard = true: the progress lines' figures also go to TensorBoard, under <run>/tensorboard/, beside
metrics.jsonl; without the tensorboard package the key is refused before anything starts, saying what to install."""
from __future__ import annotations

import importlib.util
import json
import statistics

import pytest

from psarch.cli import main
from tiny import tiny

TINY = tiny(log_every=3, train="tensorboard = true")


def test_the_event_file_holds_the_progress_lines_loss(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "tb.toml").write_text(TINY)
    assert main(["run", str(tmp_path / "tb.toml"), "--out", str(tmp_path / "tb"), "--quiet"]) == 0
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    assert {"loss", "samples_per_s", "bytes_sent_per_step"} <= set(events.Tags()["scalars"])
    rows = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    loss = {e.step: e.value for e in events.Scalars("loss")}
    assert sorted(loss) == [3, 6]
    for step, value in loss.items():   # the progress line's: metrics.jsonl's loss over its 3 steps
        assert value == pytest.approx(statistics.fmean(r["loss"] for r in rows[step - 3:step]), rel=1e-6)


def test_without_the_package_the_key_is_a_config_error_naming_the_extra(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    (tmp_path / "tb.toml").write_text(TINY)
    assert main(["run", str(tmp_path / "tb.toml"), "--out", str(tmp_path / "tb"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "psarch: config error: train.tensorboard = true: the tensorboard package is not installed; "
        "pip install psarch[tensorboard]"]
    assert not (tmp_path / "tb").exists()
