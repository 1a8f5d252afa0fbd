"""A single run leaves its own plot, curves.png (loss and throughput per step), and the quick start points to
`psarch compare` for several."""
from __future__ import annotations

from pathlib import Path

import pytest

from psarch.cli import main
from psarch.report.runs import load_run, trailing_mean
from tiny import tiny

TINY = tiny(log_every=3)


def test_a_run_writes_curves_png_of_its_loss_and_throughput(tmp_path, capsys):
    from psarch.report.plot_run import run_figure

    (tmp_path / "tiny.toml").write_text(TINY)
    assert main(["run", str(tmp_path / "tiny.toml"), "--out", str(tmp_path / "tiny"), "--quiet"]) == 0
    png = tmp_path / "tiny" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plotted in {png}" in capsys.readouterr().out
    run = load_run(tmp_path / "tiny")
    loss_ax, rate_ax = run_figure(run).axes
    losses = [r["loss"] for r in run["metrics"]]
    each, mean = (list(line.get_ydata()) for line in loss_ax.get_lines()[:2])
    assert each == losses and mean == pytest.approx(trailing_mean(losses, 3))   # the progress lines' window
    assert loss_ax.get_lines()[2].get_ydata()[0] == pytest.approx(run["summary"]["entropy_floor"])
    rates = list(rate_ax.get_lines()[0].get_ydata())
    assert rates == pytest.approx([4 / r["step_time_s"] for r in run["metrics"]])
    assert rate_ax.get_lines()[2].get_ydata()[0] == pytest.approx(run["summary"]["samples_per_s"])


def test_the_quick_start_names_compare_and_the_runs_plot():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "psarch compare runs/quickstart" in quick and "curves.png" in quick
