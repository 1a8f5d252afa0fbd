"""compare's embedding-table columns (psarch/report/sparse.py): what each worker holds, distinct ids measured
and expected, from run folders' figures."""
from __future__ import annotations

import pytest

from psarch import theory
from psarch.report.sparse import (embedding_held, embedding_scaling, is_sparse_run, measured_unique_ids, series,
                                    sparse_table)
from psarch.config import from_dict
from psarch.launch.outputs import identity

ROWS, DIM, TABLES = 1000, 8, 3


def fake_run(backend: dict, extra: dict | None = None, unique: list[list[int]] | None = None) -> dict:
    """A finished dlrm run as load_run returns it, with only the fields the columns read."""
    config = {"workload": {"model": "dlrm", "data": "clicks",
                           "dlrm": {"num_tables": TABLES, "rows": ROWS, "dim": DIM}, "clicks": {"zipf": 1.05}},
              "train": {"global_batch": 64, "optimizer": "sgd"}, "backend": dict({"world_size": 2}, **backend)}
    cfg = from_dict(config)
    metrics = [{"step": i, "workers": [{"extra": {"unique_ids": u}} if u is not None else {} for u in step]}
               for i, step in enumerate(unique or [])]
    summary = {"name": "s/p", **identity(cfg), "gap": 0.125, "step_time_s": 0.05,
               "traffic": {"per_rank": [{"sent_per_step": 100.0, "modelled": False},
                                        {"sent_per_step": 300.0, "modelled": False}]},
               "predicted": {"traffic_per_step": {"worker_sent": 210.0}}}
    if extra:
        summary["extra"] = extra
    return {"path": "s/p", "config": cfg.to_dict(), "summary": summary, "metrics": metrics, "run_label": "p"}


def test_ps_worker_holds_its_peak_rows_not_the_table():
    run = fake_run({"kind": "ps", "embeddings": "rows"}, extra={"embedding_bytes_held_peak": [640, 1280]})
    assert embedding_held(run) == (1280.0, float(TABLES * ROWS * DIM * 4))


def test_sharded_rank_holds_its_shard():
    run = fake_run({"kind": "ddp", "embeddings": "sharded"}, extra={"embedding_bytes": [48000, 48000]})
    assert embedding_held(run) == (48000.0, float(TABLES * ROWS * DIM * 4))


def test_replicating_backends_hold_the_whole_tables():
    run = fake_run({"kind": "ddp"})
    assert embedding_held(run) == (float(TABLES * ROWS * DIM * 4),) * 2


def test_unique_ids_mean_over_steps_and_workers_and_none_when_unreported():
    assert measured_unique_ids(fake_run({"kind": "ddp"}, unique=[[10, 20], [30, 60]])) == pytest.approx(30.0)
    assert measured_unique_ids(fake_run({"kind": "ddp"}, unique=[[None, None]])) is None


def test_table_row_shows_measured_beside_predicted():
    run = fake_run({"kind": "ps", "embeddings": "rows"}, extra={"embedding_bytes_held_peak": [640, 1280]},
                   unique=[[90, 110]])
    assert is_sparse_run(run)
    row = sparse_table([run]).splitlines()[2]
    expected = theory.expected_unique_ids(from_dict(run["config"]))
    cells = [c.strip() for c in row.split("|")]
    assert cells[1:5] == ["p", "ps sync, 1 server, embeddings rows", str(ROWS), "1.05"]
    assert "200 B" in cells[5] and "210 B" in cells[6]         # mean of 100 and 300 sent, beside the prediction
    assert cells[8] == "1.25 KiB \\" and cells[9] == "93.75 KiB"
    assert cells[10] == "100 \\" and cells[11] == f"{expected:.0f}"
    assert cells[12] == "0.1250"


def test_non_dlrm_runs_are_not_sparse():
    run = fake_run({"kind": "ddp"})
    run["config"]["workload"]["model"] = "gpt"
    assert not is_sparse_run(run)


def test_series_groups_by_zipf_and_variant_sorted_by_rows(tmp_path):
    big = fake_run({"kind": "ddp"})
    big["config"]["workload"]["dlrm"]["rows"] = 10 * ROWS
    big["summary"]["step_time_s"] = 0.5
    small, skewed = fake_run({"kind": "ddp"}), fake_run({"kind": "ddp"})
    skewed["config"]["workload"]["clicks"]["zipf"] = 1.5
    skewed["summary"]["label"] = "ddp ring, embeddings sharded"   # series groups by the architecture's label
    got = series([big, skewed, small])
    assert list(got) == [1.05, 1.5]
    assert got[1.05] == {"ddp ring": [(ROWS, 200.0, 210.0, 0.05), (10 * ROWS, 200.0, 210.0, 0.5)]}
    assert got[1.5] == {"ddp ring, embeddings sharded": [(ROWS, 200.0, 210.0, 0.05)]}
    assert (tmp_path / f"{embedding_scaling([big, small], tmp_path)}.png").stat().st_size > 0


def test_measured_beside_predicted_bytes_never_fill_a_panel(tmp_path, monkeypatch):
    """526,920 B measured beside 526,916 B predicted: the log axis spans at least a decade (a 4-byte difference is
    not drawn as the panel's height), and the legend sits beside the panels, not on them."""
    import matplotlib.pyplot as plt

    from psarch.report import style as plot_style
    figs = []
    monkeypatch.setattr(plot_style, "save", lambda fig, out, name: figs.append(fig) or name)
    run = fake_run({"kind": "ddp"})
    run["summary"]["traffic"]["per_rank"] = [{"sent_per_step": 526920.0, "modelled": False}] * 2
    run["summary"]["predicted"]["traffic_per_step"]["worker_sent"] = 526916.0
    embedding_scaling([run], tmp_path)
    top, bottom = figs[0].axes[:2]
    for ax in (top, bottom):
        lo, hi = ax.get_ylim()
        assert hi / lo >= 10
    figs[0].canvas.draw()
    legend = figs[0].legends[0].get_window_extent()
    assert not any(legend.overlaps(ax.get_window_extent()) for ax in figs[0].axes)
    plt.close(figs[0])
