"""What the report's plots derive, checked without drawing: panels by mode, async losses placed by the
model version they were computed on, one colour per configuration across world sizes."""
from __future__ import annotations

from psarch.config import from_dict
from psarch.curves import panel_of, per_update
from psarch.outputs import identity
from psarch.plots import predicted_step_time
from psarch.plot_style import Palette


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
