"""The study's recorded step times re-predicted by this checkout's theory, the compression's own work included
(collective/compression_theory.py's compression_work, psarch/ps/theory.py's compressing_bytes, priced by the
virtual device's rates: psarch.cluster.device.rates).

The run folders behind results/gpt.md, dlrm.md and gpt_geo.md are gone, so each row's inputs come from what was
recorded and from the study's configs: the point's config (the *_time*.toml sweeps, its N, link and the row's D),
its compute (the virtual device's forward and backward, FLOPs counted now / the device's rate: what the runs'
summaries recorded as modelled compute) and α (this machine's loopback α now / D, as
experiments/cluster_crossover/repredict.py). Each row is predicted twice: with the compression's work priced
("now") and with it left out ("no work": what the recorded predictions were; where the two recorded and no-work
figures differ, something else in the inputs or the theory moved). Prints a table and how many are within 10%.

    python experiments/compression/repredict.py [--tables DIR] [--markdown OUT.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path
from typing import Any

from psarch.cluster.alpha import loopback_alpha
from psarch.cluster.device import flops_per_s
from psarch.cluster.flops import count
from psarch.config import load_config
from psarch.launch.sweep import expand, point_overrides, read_sweep
from psarch.theory import cluster_step
from psarch.workload import build_workload

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run_figures import point  # noqa: E402

TABLES = ("gpt", "dlrm", "gpt_geo")
CONFIGS = {"gpt": ["gpt_time.toml", "gpt_time_n8_10g.toml", "gpt_powersgd_links.toml"],
           "dlrm": ["dlrm_time.toml"],
           "gpt_geo": ["gpt_geo_time.toml", "gpt_geo_time_10g.toml", "gpt_geo_k4_time.toml"]}
ROW = re.compile(r"^\| (\d+) \| (\d+) \| ([^|]+) \| ([^|]+) \| ([\d.]+) \\\| ([\d.]+) \(sim\) \|.*\| D = ([\d.]+), ")


def recorded(folder: Path, table: str) -> list[dict[str, Any]]:
    """The table's rows: N, link, arch, compression, measured and recorded predicted step (s), D."""
    rows = []
    for line in (folder / f"{table}.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            n, mbps, arch, comp, meas, pred, d = m.groups()
            rows.append({"table": table, "n": int(n), "mbps": float(mbps), "arch": arch.strip(),
                         "compression": comp.strip(), "measured": float(meas) / 1e3, "predicted": float(pred) / 1e3,
                         "dilation": float(d)})
    return rows


def points(table: str) -> dict[tuple[str, str, int, float], list[str]]:
    """The sweeps' points of a table by (arch, compression, N, link Mbit/s): (config, its --set overrides)."""
    out: dict[tuple[str, str, int, float], list[str]] = {}
    for name in CONFIGS[table]:
        config = str(HERE / name)
        sweep = read_sweep(config)
        assert sweep is not None, name
        for n in ([4, 8] if name in ("gpt_time.toml", "dlrm_time.toml") else [None]):
            base = [f"backend.world_size={n}"] if n else []
            for p in expand(config, sweep, base):
                sets = point_overrides(base, p.overrides)
                cfg = load_config(config, sets)
                key = (*point({"config": dataclasses.asdict(cfg)}), cfg.backend.world_size, cfg.cluster.link_mbps)
                out.setdefault(key, [config, *sets])
    return out


def step_summary(cfg: Any, alpha: float, cache: dict) -> dict[str, Any]:
    """What cluster_step reads of a run's summary.json: Φ and the virtual device's modelled compute, from the
    FLOPs of a worker's batch at the device's rate."""
    key = repr((cfg.workload, cfg.train.global_batch, cfg.backend.world_size))
    if key not in cache:
        wl = build_workload(cfg)
        f = count(wl.model, wl.loss_fn, wl.batch(0, 0, cfg.backend.world_size))
        cache[key] = (sum(p.numel() for p in wl.model.parameters() if p.requires_grad), f.forward, f.backward)
    phi, fwd, bwd = cache[key]
    rate, d = flops_per_s(cfg), float(cfg.cluster.dilation)
    return {"params": phi, "step_time_s": math.nan, "cluster": {"alpha_s": alpha}, "extra": {},
            "virtual_device": {"compute_s": (fwd + bwd) / rate, "forward_s": fwd / rate, "backward_s": bwd / rate,
                               "dilation": d}}


def no_work() -> Any:
    """A context in which the compression's work is left out of the programs (what the recorded predictions had)."""
    from contextlib import ExitStack
    from unittest import mock
    stack = ExitStack()
    stack.enter_context(mock.patch("collective.compression_theory.compression_work",
                                   lambda *a, **k: ((0.0, 0.0), (0.0, 0.0))))
    stack.enter_context(mock.patch("psarch.ps.theory.compressing_bytes", lambda *a, **k: 0.0))
    return stack


_FACTS: dict[str, Any] = {}   # each table's points, the models' FLOPs, α: found once per process


def predictions(table: str, n: int, mbps: float, arch: str, compression: str, dilation: float) -> tuple[float, float]:
    """(now, no work): the step predicted for the table's point at N, link and D, with the compression's work priced
    and with it left out; nan where no config of the table holds the point."""
    if "alpha" not in _FACTS:
        _FACTS["alpha"], _FACTS["models"] = loopback_alpha(), {}
    if table not in _FACTS:
        _FACTS[table] = points(table)
    sets = _FACTS[table].get((arch, compression, n, mbps))
    if sets is None:
        return math.nan, math.nan
    cfg = load_config(sets[0], [*sets[1:], f"cluster.dilation={dilation:g}"])
    s = step_summary(cfg, _FACTS["alpha"], _FACTS["models"])
    now = cluster_step(cfg, s)["predicted_s"]
    with no_work():
        return now, cluster_step(cfg, s)["predicted_s"]


def predicted_now(table: str, n: int, mbps: float, arch: str, compression: str, dilation: float) -> float:
    """The step this checkout's theory predicts for the table's point (the compression's work priced)."""
    return predictions(table, n, mbps, arch, compression, dilation)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=Path, default=HERE / "results",
                    help="the folder of the tables as recorded (before tables.py --repredict wrote this theory's)")
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args()
    done = []
    lines = ["| table | N | link | arch | compression | measured | recorded prediction | no work | now | "
             "work (ms) | error now |", "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for table in TABLES:
        for r in recorded(a.tables, table):
            now, before = predictions(table, r["n"], r["mbps"], r["arch"], r["compression"], r["dilation"])
            if math.isnan(now):
                lines.append(f"| {table} | {r['n']} | {r['mbps']:g} | {r['arch']} | {r['compression']} | "
                             f"(not a point of the configs) |")
                continue
            done.append((r, now, before))
            lines.append(f"| {table} | {r['n']} | {r['mbps']:g} | {r['arch']} | {r['compression']} | "
                         f"{r['measured'] * 1e3:.1f} | {r['predicted'] * 1e3:.1f} | {before * 1e3:.1f} | "
                         f"{now * 1e3:.1f} | {(now - before) * 1e3:.2f} | {r['measured'] / now - 1:+.1%} |")
    text = (f"`python experiments/compression/repredict.py --tables TABLES --markdown {a.markdown}`, TABLES "
            f"the tables as recorded before `tables.py --repredict` (commit eee6082's results/) (α {_FACTS['alpha'] * 1e6:.0f} us / D; times in ms; work: the compression's priced work a step)\n\n"
            + "\n".join(lines) + "\n\n" + tally(done) + "\n")
    print(text)
    if a.markdown:
        a.markdown.write_text(text)


def tally(done: list[tuple[dict[str, Any], float, float]]) -> str:
    """Within 10%: now, with the work left out, and as recorded; the rows whose no-work figure is not the recorded."""
    def within(pred: list[float]) -> int:
        return sum(abs(r["measured"] / p - 1) <= 0.1 for (r, *_), p in zip(done, pred))
    moved = [r for r, _, b in done if abs(b / r["predicted"] - 1) > 0.01]
    return (f"{len(done)} points; within 10% of the measured step: {within([x[1] for x in done])} now (the "
            f"compression's work priced), {within([x[2] for x in done])} with it left out, "
            f"{within([x[0]['predicted'] for x in done])} as recorded; rows whose no-work prediction is more than 1% "
            f"from the recorded one: {len(moved)}")


if __name__ == "__main__":
    main()
