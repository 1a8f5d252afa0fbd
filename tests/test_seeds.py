"""Studies with repeated seeds (psarch/report/seeds.py): runs that differ only in seed form one group; compare reports
each group's mean and 95% confidence interval and draws the mean loss with a band."""
from __future__ import annotations

import math

import pytest

from psarch.report import curves, plots
from psarch.cli import main
from psarch.report.compare import seeds_table
from psarch.report.style import Palette
from psarch.report.runs import load_run, name_runs
from psarch.report.seeds import interval, seed_groups, t975

SWEEP = """
[workload]
model = "mlp"
seq_len = 4
[workload.mlp]
n_embd = 8
hidden = 16
n_layer = 1
[workload.markov]
vocab_size = 8
branching = 2
[train]
steps = 12
global_batch = 4
log_every = 100
[sweep]
seed = [0, 1, 2]
points = [{ "train.lr" = 0.001 }, { "train.lr" = 0.01 }]
"""


def test_interval_is_students_t_over_the_seeds():
    ci = interval([1.0, 2.0, 3.0])
    assert ci.mean == 2.0 and ci.n == 3 and ci.half == pytest.approx(4.303 / math.sqrt(3))
    assert interval([5.0, float("nan"), None]).n == 1 and math.isnan(interval([5.0]).half)
    assert interval([float("inf")]) is None
    assert t975(1) == 12.706 and t975(4) == 2.776 and t975(27) == 2.060 and t975(100) == 1.96
    with pytest.raises(ValueError):
        t975(0)


def test_runs_differing_only_in_seed_form_a_group():
    def run(seed, lr, name):
        return {"config": {"seed": seed, "name": name, "out": f"/o/{name}", "train": {"lr": lr}}}
    runs = [run(0, 0.1, "a"), run(0, 0.2, "b"), run(1, 0.1, "c"), run(2, 0.1, "d")]
    assert [[r["config"]["name"] for r in g] for g in seed_groups(runs)] == [["a", "c", "d"], ["b"]]
    again = [run(0, 0.1, "a"), run(0, 0.1, "e")]   # one config run twice: not a study of seeds
    assert [[r["config"]["name"] for r in g] for g in seed_groups(again)] == [["a"], ["e"]]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A sweep of 3 seeds x 2 learning rates of a tiny MLP, run by `psarch run` with its compare."""
    root = tmp_path_factory.mktemp("seeds")
    (root / "study.toml").write_text(SWEEP)
    assert main(["run", str(root / "study.toml"), "--out", str(root / "study"), "--quiet"]) == 0
    return root / "study"


def test_compare_reports_each_seed_group_with_its_interval(study):
    report = (study / "compare" / "report.md").read_text()
    assert "## Seeds" in report
    section = report.split("## Seeds", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "seed0" in line]
    assert len(rows) == 2, rows   # one per learning rate, each over seeds 0, 1, 2
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[3] == "0, 1, 2" and "± " in cells[4] and cells[4].endswith("(n=3)")
    runs = [load_run(p) for p in sorted(study.glob("*/summary.json"), key=str) for p in [p.parent]]
    name_runs(runs)
    gaps = {}
    for run in runs:   # the interval is over each seed's own mean gap of its last steps
        key = run["config"]["train"]["lr"]
        losses = [r["loss"] for r in run["metrics"]]
        gaps.setdefault(key, []).append(sum(losses[-12:]) / len(losses[-12:]) - run["summary"]["entropy_floor"])
    table = seeds_table(runs, last=12)
    for lr, values in gaps.items():
        assert str(interval(values)) in table, (lr, table)


def test_the_loss_plot_draws_the_mean_with_a_band(study, monkeypatch):
    runs = [load_run(p.parent) for p in sorted(study.glob("*/summary.json"), key=str)]
    name_runs(runs)
    fig = curves.loss_figure(runs, Palette(runs))
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert sum("mean of 3 seeds" in label for label in labels) == 2, labels
    assert len(ax.collections) == 2   # one band per group
    plots.plt.close(fig)


def test_a_failed_seed_is_listed_and_counted_as_stopped_in_its_group(study, tmp_path):
    """A point that stopped (a diverged run the non-finite guard ended, say) has no figures, but the sweep's report
    must not read as if the group had lost no run: it is listed under "Left out" and counted in its group's row."""
    import json
    import shutil

    from psarch.report.compare import compare

    sweep = tmp_path / "study"
    shutil.copytree(study, sweep)
    stopped = next(p for p in sorted(sweep.iterdir()) if p.is_dir() and "seed1" in p.name)
    summary = json.loads((stopped / "summary.json").read_text())
    (stopped / "summary.json").write_text(json.dumps(dict(summary, status="failed", error="NonFiniteError: ...")))
    report = compare([sweep], tmp_path / "compare").read_text()
    assert f"{stopped}: failed" in report.split("Left out", 1)[1]
    section = report.split("## Seeds", 1)[1].split("\n## ", 1)[0]
    lr = json.loads((stopped / "config.json").read_text())["train"]["lr"]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "seed0" in line]
    cells = {row: [c.strip() for c in row.split("|")[1:-1]] for row in rows}
    hit = [c for c in cells.values() if c[3] == "0, 2"]
    assert len(hit) == 1 and hit[0][-1] == "1 (1)", (lr, rows)
    assert [c[-1] for c in cells.values() if c[3] == "0, 1, 2"] == ["0"]
