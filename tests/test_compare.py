"""Sweeps and `psarch compare`: every point runs (a failing one is reported), the report holds the runs' numbers
and every plot is a non-empty PNG (compare's tables from runs made by hand: tests/test_compare_tables.py; a sweep's
own options: tests/test_sweep_options.py)."""
from __future__ import annotations

import json

import pytest

from psarch.launch.sweep import read_sweep, run_sweep
from in_process import psarch_cli

TINY = """
name = "sw"
[workload]
seq_len = 8
[workload.gpt]
n_layer = 1
n_embd = 16
n_head = 2
[train]
steps = 4
global_batch = 4
log_every = 2
"""
SWEEP = """
[sweep]
backend = ["single", "ddp"]
"backend.comm" = ["ring", "native"]
points = [{}, { "workload.factory" = "factories:fails_at_step_2" }]
"""


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    (root / "sw.toml").write_text(TINY + SWEEP)
    points = run_sweep(root / "sw.toml", read_sweep(root / "sw.toml"), out=root / "out", echo=False)
    return root, points


def test_sweep_runs_every_point_and_reports_the_failing_ones(sweep_run):
    root, points = sweep_run
    status = {p.name: p.status for p in points}
    # comm does not apply to single: its two points are one
    assert status == {"single": "done", "ddp-commring": "done", "ddp-commnative": "done",
                      "factoryfactories_fails_at_step_2-single": "failed",
                      "factoryfactories_fails_at_step_2-ddp-commring": "failed",
                      "factoryfactories_fails_at_step_2-ddp-commnative": "failed"}
    failed = next(p for p in points if p.status == "failed")
    assert "deliberate failure at step 2" in failed.detail
    recorded = json.loads((root / "out" / "sweep.json").read_text())
    assert {r["name"]: r["status"] for r in recorded} == status
    for name in ("single", "ddp-commring", "ddp-commnative"):
        assert (root / "out" / name / "summary.json").is_file()


def test_sweep_skips_finished_points_unless_rerun(sweep_run):
    root, _ = sweep_run
    again = run_sweep(root / "sw.toml", read_sweep(root / "sw.toml"), out=root / "out", echo=False)
    assert {p.name: p.status for p in again if "fails" not in p.name} == \
        {"single": "skipped", "ddp-commring": "skipped", "ddp-commnative": "skipped"}



def test_compare_writes_report_and_plots(sweep_run, tmp_path, capsys):
    root, points = sweep_run
    runs = [str(root / "out" / n) for n in ("single", "ddp-commring", "ddp-commnative")]
    out = tmp_path / "cmp"
    code, _, err = psarch_cli(capsys, "compare", *runs, "--out", str(out))
    assert code == 0, err
    report = (out / "report.md").read_text()
    for run in runs:   # each named by its folder, not by the config's name all three share ("sw/...")
        s = json.loads((root / "out" / run.split("/")[-1] / "summary.json").read_text())
        row = next(line for line in report.splitlines() if line.startswith(f"| {run.split('/')[-1]} |"))
        assert f"{s['final_loss']:.4f}" in row and f"{s['samples_per_s']:.1f}" in row
        assert s["samples_per_s"] == pytest.approx(s["global_batch"] / s["step_time_s"])   # in lockstep
        assert s["samples_per_s_is"] == "global batch / median step time"
    assert "not directly comparable" not in report
    for name in ("loss", "loss_time", "memory", "traffic", "throughput"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
        assert f"![{name}]({name}.png)" in report


def test_compare_warns_when_runs_are_not_comparable(sweep_run, tmp_path):
    root, _ = sweep_run
    (tmp_path / "other.toml").write_text(TINY.replace("global_batch = 4", "global_batch = 8"))
    from psarch import load_config, run
    run(load_config(tmp_path / "other.toml"), out=tmp_path / "other", echo=False)
    from psarch.report.compare import compare
    report = compare([root / "out" / "single", tmp_path / "other"], tmp_path / "cmp").read_text()
    assert "not directly comparable" in report and "global_batch: 8 vs 4" in report


def test_compare_takes_a_sweep_folder_as_its_finished_points(sweep_run, tmp_path):
    """`psarch compare runs/<sweep>`: the sweep's run folders in its order; the failed points named as left out."""
    from psarch.cli import main

    root, _ = sweep_run
    assert main(["compare", str(root / "out"), "--out", str(tmp_path / "cmp")]) == 0
    report = (tmp_path / "cmp" / "report.md").read_text()
    rows = [line.split(" | ")[0][2:] for line in report.split("## ")[0].splitlines() if line.startswith("| ")]
    assert rows[1:] == ["single", "ddp-commring", "ddp-commnative"], rows
    for name in ("single", "ddp-commring", "ddp-commnative"):
        assert f"factoryfactories_fails_at_step_2-{name}: failed" in report
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty"), "--out", str(tmp_path / "c2")]) == 2


@pytest.fixture(scope="module")
def async_run(sweep_run):
    """A parameter-server async run on the sweep's workload: server traffic and a staleness histogram."""
    root, _ = sweep_run
    (root / "ps.toml").write_text(TINY.replace('name = "sw"', 'name = "psasync"')
                                  + '[backend]\nkind = "ps"\nmode = "async"\nworld_size = 2\n')
    from psarch import load_config, run
    run(load_config(root / "ps.toml"), out=root / "psasync", echo=False)
    return root / "psasync"


def test_compare_shows_server_traffic_and_staleness(sweep_run, async_run, tmp_path):
    root, _ = sweep_run
    from psarch.report.compare import compare
    from psarch.units import fmt_bytes
    report = compare([root / "out" / "single", async_run], tmp_path / "cmp").read_text()
    s = json.loads((async_run / "summary.json").read_text())
    assert sum(s["staleness"]["histogram"].values()) == s["staleness"]["updates"] > 0
    row = next(line for line in report.splitlines() if "| psasync |" in line)
    recv = s["traffic"]["servers"][0]["received"] / s["steps"]
    assert f"{fmt_bytes(recv)} \\| {fmt_bytes(s['predicted']['traffic_per_step']['server_received'])}" in row
    # the convergence table: the last steps' mean gap, and the async run's staleness
    losses = [json.loads(line)["loss"] for line in (async_run / "metrics.jsonl").read_text().splitlines()]
    gap = sum(losses[-20:]) / len(losses[-20:]) - s["entropy_floor"]
    conv = report.split("## Convergence")[1]
    row = next(line for line in conv.splitlines() if "| psasync |" in line)
    assert f"| psasync | 2 | {gap:.4f} |" in row
    assert row.endswith(f"| {s['staleness']['mean']:.2f} / {s['staleness']['max']} |")
    # steps and time to a target gap: a target this run first crosses at step k, from the 10-step means
    # computed here, so both columns are checked against an independent count
    rows = [json.loads(line) for line in (async_run / "metrics.jsonl").read_text().splitlines()]
    means = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) - s["entropy_floor"]
             for i in range(len(losses))]
    k = next((i for i in range(1, len(means)) if means[i] < min(means[:i])), 0)
    target = (means[k] + min(means[:k])) / 2 if k else means[0] + 1.0
    clock = [sum(r["step_time_s"] for r in rows[:i + 1]) for i in range(len(rows))]
    conv = compare([async_run], tmp_path / "conv", target_gap=target).read_text().split("## Convergence")[1]
    row = next(line for line in conv.splitlines() if "| psasync |" in line)
    assert f"| {k + 1} | {clock[k]:.2f} |" in row, (k, target, row)
    data = (tmp_path / "cmp" / "staleness.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "![staleness](staleness.png)" in report


def test_async_samples_per_s_is_the_sum_of_each_workers_own_rate(async_run, tmp_path):
    """The summary, report.txt, compare and the straggler tables give an async run one samples/s: each worker's
    shard over its own median step time (after warm-up), summed; an older summary's figure is recomputed."""
    import shutil
    import statistics

    from psarch.report.stragglers import rows as straggler_rows
    from psarch.report.compare import compare
    from psarch.report.runs import load_run

    s = json.loads((async_run / "summary.json").read_text())
    metrics = [json.loads(line) for line in (async_run / "metrics.jsonl").read_text().splitlines()]
    warm = min(5, s["steps"] // 5)
    own = sum(2 / statistics.median(r["workers"][w]["step_time_s"] for r in metrics[warm:]) for w in range(2))
    assert s["samples_per_s"] == pytest.approx(own)
    from psarch.throughput import OWN_PACE
    assert s["samples_per_s_is"] == OWN_PACE
    assert f"{s['samples_per_s']:.1f} samples/s ({OWN_PACE})" in (async_run / "report.txt").read_text()
    old = tmp_path / "sweep" / "old"
    shutil.copytree(async_run, old)
    stale = dict(s, samples_per_s=4 / s["step_time_s"])   # as summaries said before: the slowest worker's clock
    del stale["samples_per_s_is"]
    (old / "summary.json").write_text(json.dumps(stale))
    assert load_run(old)["summary"]["samples_per_s"] == pytest.approx(own)
    assert straggler_rows(old.parent)[0]["samples_per_s"] == pytest.approx(own)
    assert straggler_rows(old.parent)[0]["run"] == "old"   # its folder: a run made again replaces it by name
    report = compare([old], tmp_path / "cmp").read_text()
    assert f"| old | ps async, 1 server | 2 | {own:.1f} |" in report and f"{OWN_PACE} where they run at" in report

def test_compare_refuses_a_target_gap_that_is_not_positive(async_run, tmp_path, capsys):
    from psarch.cli import main

    assert main(["compare", str(async_run), "--out", str(tmp_path / "c"), "--target-gap", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target-gap 0: must be a number > 0" in err[0], err


def test_estimate_from_a_measured_run(async_run, capsys):
    from psarch.units import fmt_size, fmt_time
    code, out, err = psarch_cli(capsys, "estimate", "--from", str(async_run))
    assert code == 0, err
    s = json.loads((async_run / "summary.json").read_text())
    label = s.get("label") or "ps async"
    assert f"== measured run {s['name']} ({label}, N = 2): compute " in out
    assert f"step time  measured {s['step_time_s'] * 1e3:.2f} ms" in out
    sent = sum(t["sent_per_step"] for t in s["traffic"]["per_rank"]) / 2
    assert f"sent/step  measured {fmt_size(sent)}   model {fmt_size(s['params'] * 4)}" in out
    # the step-time table takes compute from the run: at N = 1 nothing is communicated, so a step is
    # the run's own step time less its communication wait
    compute = s["step_time_s"] - s["comm_s"]
    assert f"compute {fmt_time(compute)}/step/worker (measured in {async_run})" in out
    assert "== step time (ms)" in out
    row = next(line.split() for line in out.split("== step time")[1].splitlines() if line.split()[:1] == ["1"])
    assert row[1] == f"{compute * 1e3:.3g}", row
    code, _, err = psarch_cli(capsys, "estimate", "--from", str(async_run.parent))
    assert code == 2 and "no summary.json" in err


def test_compare_writes_under_runs_by_default(async_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = psarch_cli(capsys, "compare", str(async_run))
    assert code == 0, err
    assert (tmp_path / "runs" / "compare" / "psasync" / "report.md").is_file()
    assert not (tmp_path / "compare").exists()


def test_estimate_and_compare_name_a_failed_run_in_one_line(tmp_path, capsys):
    from psarch.cli import main

    cfg = tmp_path / "f.toml"
    cfg.write_text(TINY)
    assert main(["run", str(cfg), "--set", "workload.factory=factories:fails_at_step_2", "--out",
                 str(tmp_path / "f"), "--quiet"]) == 1
    capsys.readouterr()
    assert main(["estimate", "--from", str(tmp_path / "f")]) == 2
    assert main(["compare", str(tmp_path / "f"), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("the run failed (" in e and "no figures to load" in e for e in err), err
