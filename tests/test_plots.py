"""What the report's plots derive, checked without looking at pixels: panels by workload and mode, async losses
placed by the model version they were computed on, one colour per configuration across world sizes, runs named
by folder; axis scales and ranges, what each label says and where it sits, legends off the data."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from psarch.report import curves, plots
from psarch.config import from_dict
from psarch.report.curves import panel_of, per_update
from psarch.launch.outputs import identity
from psarch.report.plots import predicted_step_time
from psarch.report.style import Palette


def run(name: str, backend: str, variant: str, n: int, rows: list | None = None) -> dict:
    """A run's summary as outputs.identity writes it, for a backend and variant."""
    options = {"ps": {"mode": variant}, "zero": {"stage": int(variant[5:6] or 1)} if variant else {}}.get(backend, {})
    cfg = from_dict({"backend": {"kind": backend, "world_size": 1 if backend == "single" else n, **options}})
    return {"path": f"/runs/{name}", "summary": {"name": "sweep", **identity(cfg)}, "metrics": rows or [],
            "run_label": name.rsplit("/", 1)[-1]}


def test_synchronous_backends_share_a_panel_and_each_ps_mode_has_its_own():
    assert {panel_of(run("a", b, v, 4)) for b, v in (("single", ""), ("ddp", "ring"), ("zero", "stage3/ring"),
                                                      ("torch_fsdp", ""), ("ps", "sync"))} == {"synchronous"}
    assert [panel_of(run("a", "ps", m, 4)) for m in ("async", "geo", "ssp")] == [
        "ps async, 1 server", "ps geo, 1 server", "ps ssp, 1 server"]


def test_async_losses_are_placed_by_model_version_not_by_each_workers_step():
    """Worker 1 starts late: its first steps run on a model the other worker already updated 4 times.
    By step it would sit at x = 1, 2; by version (updates / N) at 2.0 and 2.5 (its first loss, whose
    version is not recorded, is left out)."""
    def w(rank: int, loss: float, version: int) -> dict:
        return {"rank": rank, "loss": loss, "extra": {"version": version, "t_start": 0.0, "t_end": 1.0}}
    rows = [{"step": 0, "loss": 0, "workers": [w(0, 5.0, 1), w(1, 9.0, 5)]},
            {"step": 1, "loss": 0, "workers": [w(0, 4.0, 2), w(1, 8.0, 6)]},
            {"step": 2, "loss": 0, "workers": [w(0, 3.0, 3), w(1, 7.0, 7)]}]
    xs, losses = per_update(run("a", "ps", "async", 2, rows), "step")
    assert xs == [0.5, 1.0, 2.5, 3.0] and losses == [4.0, 3.0, 8.0, 7.0]


def test_one_colour_per_configuration_across_world_sizes():
    runs = [run(f"sw/mode{m}-world_size{n}", "ps", m, n) for m in ("sync", "async") for n in (2, 4)]
    p = Palette(runs)
    assert p.colour(runs[0]) == p.colour(runs[1]) != p.colour(runs[2]) == p.colour(runs[3])
    assert p.line(runs[0])["ls"] != p.line(runs[1])["ls"]
    assert p.name(runs[0]) == "modesync-world_size2"


def test_the_throughput_plot_reads_theorys_step_time_where_the_summary_holds_it():
    """An emulated run's summary holds theory's step time under cluster.step_time; a loopback run has none."""
    emulated = {"cluster": {"emulated": True, "step_time": {"measured_s": 0.92, "predicted_s": 0.87}}}
    assert predicted_step_time(emulated) == 0.87
    assert predicted_step_time({"predicted": {"memory_per_rank": {}}}) is None


# ---- what the figures derive (issue 20): axes, labels, positions, never pixels

def full_run(path: str, backend: str = "ddp", variant: str = "", n: int = 2, losses: list | None = None,
             floor: float | None = None, sent: float = 1e6, workload: dict | None = None, lr: float = 0.1,
             **summary) -> dict:
    """A finished run as compare holds it: summary (identity's fields and the figures the plots read),
    config and per-step metrics, named by its folder."""
    options = {"ps": {"mode": variant}}.get(backend, {})
    cfg = from_dict({"name": "mine", "workload": workload or {}, "train": {"lr": lr},
                     "backend": {"kind": backend, "world_size": 1 if backend == "single" else n, **options}})
    losses = losses if losses is not None else [4.0 - 0.1 * i for i in range(20)]
    mem = {"params": 4e5, "grads": 4e5, "optimizer": 8e5, "total": 1.6e6}
    s = {"name": "mine", **identity(cfg), "workload": "gpt/markov", "entropy_floor": floor, "global_batch": 32,
         "samples_per_s": 100.0, "steps": len(losses), "staleness": None,
         "memory": {"per_rank": [dict(mem, rank=r) for r in range(n)]},
         "traffic": {"per_rank": [{"sent_per_step": sent, "modelled": False} for _ in range(n)]},
         "predicted": {"memory_per_rank": {"total": 1.6e6}, "traffic_per_step": {"worker_sent": sent}}}
    s.update(summary)
    rows = [{"step": i, "loss": v, "step_time_s": 0.01} for i, v in enumerate(losses)]
    return {"path": path, "summary": s, "config": cfg.to_dict(), "metrics": rows, "run_label": Path(path).name}


@pytest.fixture
def drawn(monkeypatch):
    """draw(plot, runs, ...): the figure a report's plot function (curves.loss_curves, plots.traffic, ...) builds,
    caught where it would be saved, for a test to read its axes."""
    figs = []
    for module in (curves, plots):
        monkeypatch.setattr(module, "save", lambda fig, out, name: figs.append(fig) or name)

    def draw(plot, runs: list[dict], *args):
        plot(runs, Path("."), Palette(runs), *args)
        return figs[-1]
    yield draw
    for fig in figs:
        plt.close(fig)


def lines_of(fig) -> dict[str, tuple[list, list]]:
    """Every drawn curve by its legend label: (x, y)."""
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ax in fig.axes for ln in ax.get_lines()}


def inside(inner, outer, slack: float = 1.0) -> bool:
    return (inner.x0 >= outer.x0 - slack and inner.y0 >= outer.y0 - slack and inner.x1 <= outer.x1 + slack
            and inner.y1 <= outer.y1 + slack)


def check_layout(fig) -> None:
    """Nothing truncated by the figure's edge (titles, axis labels, legends), and no legend on any axes' data."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    box = fig.bbox
    texts = [fig._suptitle] if fig._suptitle else []
    for ax in fig.axes:
        if ax.get_visible():
            texts += [ax.title, ax.xaxis.label, ax.yaxis.label]
    for t in texts:
        if t.get_text():
            assert inside(t.get_window_extent(r), box), f"cut by the figure's edge: {t.get_text()!r}"
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    for leg in legends:
        lb = leg.get_window_extent(r)
        assert inside(lb, box), "legend cut by the figure's edge"
        for ax in fig.axes:
            if ax.get_visible():
                assert not lb.overlaps(ax.get_window_extent(r)), "a legend lies on the data"


def test_a_loss_without_floor_is_drawn_whole_and_a_run_diverged_only_by_the_stated_rule(drawn):
    """A factory's loss (no floor) that starts at 6.8 and swings to 13 before ending at 6: the axis holds the
    whole curve and nobody is called diverged. A run ending above 2x its start, or with a NaN, is."""
    swings = [6.8, 7.7, 10.9, 9.9, 5.5, 13.1, 6.7, 10.4, 5.7, 6.0] * 2
    runs = [full_run(f"r/mine{i}", losses=[v * (1 - 0.02 * i) for v in swings], workload={"factory": "factories:readme_example"})
            for i in range(3)]
    fig = drawn(curves.loss_curves, runs)
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    assert lo < min(swings) * 0.96 and hi > max(swings)
    assert sorted(lines_of(fig)) == ["mine0", "mine1", "mine2"]          # folders, and none "(diverged)"
    assert "diverged" not in fig._suptitle.get_text() and "floor" not in fig._suptitle.get_text()
    check_layout(fig)
    from psarch.report.curves import DIVERGE_FACTOR, diverged
    assert DIVERGE_FACTOR == 2.0 and not diverged([1.0, 1.9]) and diverged([1.0, 2.1])
    assert diverged([1.0, float("nan"), 0.5]) and not diverged([-2.0, -1.0]) and diverged([-2.0, 0.5])
    blown = full_run("r/blown", losses=[1.0, 3.0, 50.0, 900.0], workload={"factory": "factories:readme_example"})
    ok = full_run("r/ok", losses=[1.0, 0.8, 0.7, 0.6], workload={"factory": "factories:readme_example"})
    fig = drawn(curves.loss_curves, [ok, blown])
    assert set(lines_of(fig)) == {"ok", "blown (diverged)"}
    assert fig.axes[0].get_ylim()[1] < 2.0                                  # the axis is ok's, blown runs off it
    assert "not finite" in fig._suptitle.get_text()


def test_workloads_never_share_a_panel_an_axis_or_a_coincidence(drawn):
    """A gpt run and a dlrm run, both synchronous: two panels, each with its own loss axis; no curve called a
    coincidence with the other's. Two runs alike but for the backend coincide by design; alike but for lr,
    they need not."""
    gpt = full_run("c/gpt", losses=[4.2 - 0.1 * i for i in range(20)], floor=1.08)
    dlrm = full_run("c/dlrm", losses=[0.70 - 0.004 * i for i in range(20)], floor=0.42, workload={"model": "dlrm",
                                                                                                 "data": "clicks"})
    dlrm["summary"]["workload"] = "dlrm/clicks"
    fig = drawn(curves.loss_curves, [gpt, dlrm])
    by_title = {ax.get_title().split("\n")[0]: ax for ax in fig.axes if ax.get_visible()}
    assert set(by_title) == {"gpt/markov: synchronous", "dlrm/clicks: synchronous"}
    lo, hi = by_title["dlrm/clicks: synchronous"].get_ylim()
    assert lo < 0.42 and 0.70 < hi < 1.0                                   # dlrm's curve and floor, on its own axis
    assert by_title["gpt/markov: synchronous"].get_ylim()[1] > 4.2
    assert not any("coincide" in ax.get_title() for ax in fig.axes)
    check_layout(fig)
    from psarch.report.curves import coincide_note, panels
    assert list(panels([gpt, dlrm])) == [("gpt/markov", "synchronous"), ("dlrm/clicks", "synchronous")]
    ring, ps = full_run("a/ring"), full_run("a/ps", "ps", "sync")
    assert coincide_note([ring, ps]).startswith("2 curves coincide by design")
    assert coincide_note([ring, full_run("a/lr", lr=0.2)]) == ""


def test_own_pace_curves_are_placed_by_model_version(drawn):
    """An async run's panel reads its losses by model version, whatever its architecture label says (it names
    its servers): x = version / N."""
    def w(rank: int, loss: float, version: int) -> dict:
        return {"rank": rank, "loss": loss, "step_time_s": 0.01, "extra": {"version": version}}
    rows = [{"step": s, "loss": 0.0, "step_time_s": 0.01, "workers": [w(0, 5.0 - s, 2 * s + 1), w(1, 6.0 - s, 2 * s + 2)]}
            for s in range(3)]
    run = full_run("p/async", "ps", "async")
    run["metrics"] = rows
    fig = drawn(curves.loss_curves, [run])
    xs, _ = next(v for k, v in lines_of(fig).items() if "async" in k)
    assert xs == [0.5, 1.0, 1.5, 2.0] and "model version" in fig.axes[0].get_xlabel()


def test_runs_are_named_by_folder_never_by_a_shared_config_name():
    """Three --out runs of one config (name "mine"): three names, three colours; clashing folder names take
    their parents, clashing labels their folders, one folder given twice a number."""
    runs = [full_run(f"/x/mine{i}") for i in range(1, 4)]
    p = Palette(runs)
    assert [p.name(r) for r in runs] == ["mine1", "mine2", "mine3"]
    assert len({p.colour(r) for r in runs}) == 3
    from psarch.report.runs import name_runs
    runs = [full_run("/a/sw/p"), full_run("/b/sw/p"), full_run("/a/q"), full_run("/a/q")]
    labelled = [full_run("/a/f1"), full_run("/a/f2")]
    for r in labelled:
        r["config"]["label"] = "lr 0.1"
    name_runs(runs + labelled)
    assert [r["run_label"] for r in runs + labelled] == ["a/sw/p", "b/sw/p", "q #1", "q #2", "lr 0.1 (f1)",
                                                          "lr 0.1 (f2)"]


def test_traffic_goes_on_a_log_axis_when_bars_span_orders_of_magnitude_with_values_past_the_ticks(drawn):
    """36 MiB beside 30 KiB: a log axis, stated in its label; every bar's value written to the right of both
    its bar and theory's tick. Bars of one magnitude stay on a linear axis."""
    runs = [full_run("t/dense", sent=36 * 2**20), full_run("t/rows", sent=30 * 2**10)]
    runs[1]["summary"]["predicted"]["traffic_per_step"]["worker_sent"] = 40 * 2**10   # theory says more: tick right
    fig = drawn(plots.traffic, runs)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and "log scale" in ax.get_xlabel()
    labels = {t.get_text(): t for t in ax.texts}
    assert set(labels) == {"36.00 MiB", "30.00 KiB"}
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    ticks = [ln for ln in ax.get_lines() if ln.get_color() == "k"]
    for text, tick in zip(labels.values(), ticks):
        assert text.xy[0] >= tick.get_xdata()[0]
        assert not text.get_window_extent(r).overlaps(tick.get_window_extent(r))
        assert inside(text.get_window_extent(r), ax.get_window_extent(r))
    check_layout(fig)
    fig = drawn(plots.traffic, [full_run("t/a", sent=1e6), full_run("t/b", sent=3e6)])
    assert fig.axes[0].get_xscale() == "linear"


def test_memory_bars_are_never_clipped_by_the_frame(drawn):
    """The longest bar (or theory's tick) ends inside the frame in every panel, with a PS run among others."""
    ps = full_run("m/ps", "ps", "sync", servers=1, memory={"per_rank": [{"params": 4e5, "grads": 4e5, "total": 8e5,
                                                                          "rank": 0}],
                                                            "servers": [{"total": 2.4e6, "server": 0}]})
    ps["summary"]["predicted"]["server_memory"] = 2.4e6
    runs = [full_run("m/ddp"), ps]
    fig = drawn(plots.memory, runs)
    for ax in fig.axes:
        ends = [p.get_x() + p.get_width() for p in ax.patches] + [x for ln in ax.get_lines() for x in ln.get_xdata()]
        assert max(ends) < ax.get_xlim()[1] * 0.98, ax.get_title()
    check_layout(fig)


def test_throughput_titles_legends_and_many_runs_stay_inside_the_figure_and_off_the_data(drawn):
    """Twelve runs with long names, some at their own pace: every title, label and legend inside the figure, no
    legend on the data (loss, memory, traffic, throughput); own-pace bars hatched, the legend saying what
    samples/s means for each kind."""
    runs = [full_run(f"s/ps-servers{i % 3}-world_size{2 + 2 * (i % 2)}-link_mbps1000.0-{m}", "ps", m, 2 + 2 * (i % 2))
            for i, m in enumerate(["sync", "async", "geo", "ssp"] * 3)]
    fig = drawn(plots.throughput, runs)
    check_layout(fig)
    hatched = [bool(b.get_hatch()) for b in fig.axes[0].patches]
    assert hatched == [not r["summary"]["lockstep"] for r in runs]
    from psarch.throughput import LOCKSTEP, OWN_PACE
    legend = " ".join(t.get_text() for t in fig.legends[0].get_texts())
    assert LOCKSTEP in legend and OWN_PACE in legend
    for plot in (plots.traffic, plots.memory, curves.loss_curves):
        check_layout(drawn(plot, runs))
    few = [full_run("s/ps-servers1-world_size2-link_mbps1000.0-modesync-staleness_compensationlr"), full_run("s/b")]
    check_layout(drawn(plots.throughput, few))   # two rows: a short figure, a long tick label


def test_staleness_is_drawn_as_bars_over_integer_staleness(drawn):
    a, b = full_run("s/a", "ps", "async"), full_run("s/b", "ps", "async", n=4)
    a["summary"]["staleness"] = {"histogram": {"0": 6, "1": 3, "3": 1}, "mean": 0.7, "max": 3}
    b["summary"]["staleness"] = {"histogram": {"0": 1, "2": 1}, "mean": 1.0, "max": 2}
    fig = drawn(curves.staleness, [a, b])
    ax = fig.axes[0]
    bars = [(round(p.get_x() + p.get_width() / 2, 6), p.get_width(), p.get_height()) for p in ax.patches]
    assert all(w < 0.5 for _, w, _ in bars)
    centres = sorted({round(x) for x, _, _ in bars})
    assert centres == [0, 1, 2, 3] and all(abs(x - round(x)) < 0.5 for x, _, _ in bars)
    assert [h for _, _, h in bars[:4]] == [0.6, 0.3, 0.0, 0.1] and [h for _, _, h in bars[4:]] == [0.5, 0.0, 0.5, 0.0]
    assert all(float(t).is_integer() for t in ax.get_xticks() if -0.5 <= t <= 3.5)
    check_layout(fig)


def test_the_staleness_axis_says_what_share_of_updates_lies_beyond_it(drawn):
    """Values past the axis each hold < 1% of a run's updates, but together 2.25% of one run's: the label says
    so, computed from the histograms (it once claimed '< 1% of every run's updates')."""
    a, b = full_run("s/a", "ps", "async"), full_run("s/b", "ps", "async", n=4)
    tail = {str(k): 75 for k in range(7, 10)}   # 3 x 0.75% of 10,000 updates
    a["summary"]["staleness"] = {"histogram": {"0": 6000, "3": 1000, "6": 2775, **tail}, "mean": 1.0, "max": 9}
    b["summary"]["staleness"] = {"histogram": {"0": 1, "2": 1}, "mean": 1.0, "max": 2}
    label = drawn(curves.staleness, [a, b]).axes[0].get_xlabel()
    assert "beyond 6: at most 2.25% of a run's updates" in label and "< 1%" not in label, label
    a["summary"]["staleness"] = {"histogram": {"0": 6, "1": 4}, "mean": 0.4, "max": 1}
    assert "every update shown" in drawn(curves.staleness, [a, b]).axes[0].get_xlabel()
