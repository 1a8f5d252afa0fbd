"""Recorded emulated points re-predicted by this checkout's theory: each row of a `psarch report cluster` table
(cluster.md: architecture, N, link rate, step time measured | predicted, compute) beside the step that
psarch.theory.cluster_step (what `psarch report cluster` prints: the step simulator wherever the backend writes
its step as a program) predicts for the sweep point of the same architecture, N and link rate, from the row's
own recorded compute.

The run folders behind the recorded tables are not kept, so each point's inputs are taken from what was
recorded and from its config: its model's Φ (the config's workload), its compute (the table's column: a virtual
device's modelled compute, or the measured step less its wait), a backward share (a virtual device's modelled
backward over its forward and backward; none for measured compute) and α (this machine's loopback α, measured
now, / the row's D; the host's α over the emulated links was not recorded; at these link rates it is under 1% of
every step). Prints measured | recorded prediction | simulated per row, each error, how many are within 10% now
and with the recorded prediction, and the largest; with
--plot, the plot of measured against simulated step time beside the table.

    python experiments/cluster_crossover/repredict.py TABLE CONFIG [CONFIG ...] [--set KEY=VALUE ...]
        [--label RECORDED=TODAY ...] [--auto-depth K] [--plot PNG] [--step-plot PNG]

A row is matched to the point of the same architecture label, N and link rate in the CONFIGs (the sweeps the
table's runs were made from, with the runs' own --set overrides); the PS's labels now say ", ranges" where each
server's range is its own (round robin, the default now, goes unsaid): a row is also matched to the point whose
label less ", ranges" it is, where no point holds that label itself.
Labels recorded before today's wording ("DDP (ring)", or a default partition size that went unsaid) are named by
--label as today's label of the same point; --auto-depth gives "auto" partitions as they were when the runs ran.
A row whose point no config holds is printed as such, not guessed.
With --step-plot, `psarch report cluster`'s plot (step time against N, measured and predicted now) of the rows.
"""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any

from psarch import registry
from psarch.cluster.alpha import loopback_alpha
from psarch.cluster.flops import count
from psarch.config import load_config
from psarch.launch.sweep import expand, point_overrides, read_sweep
from psarch.ps import partitions
from psarch.theory import cluster_step
from psarch.workload import build_workload

MS = re.compile(r"([\d.]+) ms")


def recorded(table: Path) -> list[dict[str, Any]]:
    """The table's rows: architecture, N, link Mbit/s, measured, predicted and compute (seconds), D (or None)."""
    lines = [ln for ln in table.read_text().splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].replace("\\|", "/").strip("|").split("|")]
    out = []
    for ln in lines[2:]:
        cells = dict(zip(head, (c.strip() for c in ln.replace("\\|", "/").strip("|").split("|"))))
        measured, predicted = (float(x) / 1e3 for x in MS.findall(cells["step time measured / predicted"]))
        compute = next(v for k, v in cells.items() if k.startswith("compute"))
        d = cells.get("D")
        out.append({"arch": cells["architecture"], "n": int(cells["N"]), "mbps": float(cells["link Mbit/s"]),
                    "measured": measured, "predicted": predicted, "compute": float(MS.findall(compute)[0]) / 1e3,
                    "dilation": float(d) if d else None})
    return out


def points(configs: list[str], overrides: list[str]) -> dict[tuple[str, int, float], Any]:
    """The sweeps' configs (the runs' `overrides` first, then each point's) by (architecture label, N, link Mbit/s):
    today's label, and as recorded before it said the partitions' assignment (", ranges" left out) where no point
    holds that label today."""
    out, unsaid = {}, {}
    for config in configs:
        sweep = read_sweep(config)
        if sweep is None:
            raise SystemExit(f"{config}: no [sweep]")
        for point in expand(config, sweep, overrides):
            cfg = load_config(config, point_overrides(overrides, point.overrides))
            label = registry.spec_of(cfg).label(cfg)
            out[(label, cfg.backend.world_size, cfg.cluster.link_mbps)] = cfg
            unsaid[(label.replace(", ranges", ""), cfg.backend.world_size, cfg.cluster.link_mbps)] = cfg
    return unsaid | out


def model_facts(cfg: Any, cache: dict[str, tuple[int, float]]) -> tuple[int, float]:
    """Φ of cfg's model and its backward's share of a forward and backward (FLOPs, a worker's batch)."""
    key = repr((cfg.workload, cfg.train.global_batch, cfg.backend.world_size))
    if key not in cache:
        wl = build_workload(cfg)
        flops = count(wl.model, wl.loss_fn, wl.batch(0, 0, cfg.backend.world_size))
        cache[key] = (sum(p.numel() for p in wl.model.parameters() if p.requires_grad),
                      flops.backward / (flops.forward + flops.backward))
    return cache[key]


def summary(r: dict[str, Any], phi: int, share: float, alpha: float) -> dict[str, Any]:
    """What cluster_step reads of a finished run's summary.json, from the recorded row: Φ, the measured step, its
    compute (a virtual device's modelled forward and backward, at `share` backward; else the measured step less
    its wait) and α."""
    s: dict[str, Any] = {"params": phi, "step_time_s": r["measured"], "comm_s": r["measured"] - r["compute"],
                         "cluster": {"alpha_s": alpha}, "extra": {}}
    if r["dilation"] is not None:
        s["virtual_device"] = {"compute_s": r["compute"], "forward_s": r["compute"] * (1 - share),
                               "backward_s": r["compute"] * share, "dilation": r["dilation"]}
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table", type=Path)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="the runs' own --set overrides, applied to every config")
    ap.add_argument("--label", action="append", default=[], metavar="RECORDED=TODAY",
                    help="a label as recorded, and today's label of the same point")
    ap.add_argument("--auto-depth", type=int, metavar="K",
                    help="the PS's \"auto\" partitions a server's range / K, what \"auto\" was when the table's runs "
                         "ran (8 before commit 65cb074; now PIPELINE_DEPTH)")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--step-plot", type=Path)
    a = ap.parse_args()
    if a.auto_depth:   # the one figure of "auto" that changed since; the library keeps no history of its own
        partitions.PIPELINE_DEPTH = a.auto_depth
    renamed = dict(pair.split("=", 1) for pair in a.label)
    cfgs, cache, alpha = points(a.configs, a.overrides), {}, loopback_alpha()
    print(f"| architecture | N | link Mbit/s | measured | recorded prediction | predicted now | error (now) |"
          f"   (α {alpha * 1e6:.0f} us / D)")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = recorded(a.table)
    done = []
    for r in rows:
        cfg = cfgs.get((renamed.get(r["arch"], r["arch"]), r["n"], r["mbps"]))
        step = math.nan
        if cfg is not None:
            phi, share = model_facts(cfg, cache)
            step = cluster_step(cfg, summary(r, phi, share, alpha))["predicted_s"]
        print(f"| {r['arch']} | {r['n']} | {r['mbps']:g} | {r['measured'] * 1e3:.0f} ms | {r['predicted'] * 1e3:.0f} ms"
              f" | {row_result(cfg, step, r['measured'])} |")
        if not math.isnan(step):
            done.append((r, step))
    print("\n" + tally(rows, done))
    if a.plot and done:
        plot(done, a.plot)
        print(f"written {a.plot}")
    if a.step_plot and done:
        step_plot(done, a.step_plot)
        print(f"written {a.step_plot}")


def row_result(cfg: Any, step: float, measured: float) -> str:
    """A row's last two cells: predicted now and its error (measured / predicted - 1), or why there is none."""
    if cfg is None:
        return "(not a point of the configs) |"
    if math.isnan(step):   # e.g. a trainer that times no wait apart, from a contended compute
        return "(none: cluster_step gives no prediction) |"
    return f"{step * 1e3:.0f} ms | {measured / step - 1:+.1%}"


def tally(rows: list[dict[str, Any]], done: list[tuple[dict[str, Any], float]]) -> str:
    """How many points are within 10% now and how many were with the recorded prediction, and the largest errors."""
    now = [abs(r["measured"] / s - 1) for r, s in done]
    old = [abs(r["measured"] / r["predicted"] - 1) for r, _ in done]
    every = [abs(r["measured"] / r["predicted"] - 1) for r in rows]
    return (f"{len(done)} of {len(rows)} points re-predicted; within 10%: {sum(e <= 0.1 for e in now)} now, "
            f"{sum(e <= 0.1 for e in old)} with the recorded prediction (of all {len(rows)} rows: "
            f"{sum(e <= 0.1 for e in every)}); largest error: predicted now {max(now, default=math.nan):.1%}, "
            f"recorded prediction {max(old, default=math.nan):.1%}")


def plot(done: list[tuple[dict[str, Any], float]], path: Path) -> None:
    """Measured against predicted step time, a point per run (one marker per link rate), the diagonal and ±10%."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 5))
    lo = min(min(r["measured"], s) for r, s in done) * 1e3 / 1.3
    hi = max(max(r["measured"], s) for r, s in done) * 1e3 * 1.3
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="measured = predicted")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.85", label="±10%")
    for i, rate in enumerate(sorted({r["mbps"] for r, _ in done})):
        pts = [(s * 1e3, r["measured"] * 1e3) for r, s in done if r["mbps"] == rate]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "os^"[i % 3], color=f"C{i}", ms=5, alpha=0.8,
                label=f"{rate:g} Mbit/s")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="predicted now (ms)",
           ylabel="measured (ms)", title=f"{len(done)} recorded emulated points, re-predicted")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def step_plot(done: list[tuple[dict[str, Any], float]], path: Path) -> None:
    """`psarch report cluster`'s plot of the same rows: step time against N per architecture (as recorded) and
    link rate, measured and predicted now."""
    from psarch.report.cluster import plot as cluster_plot
    cluster_plot([{"arch": r["arch"], "n": r["n"], "mbps": r["mbps"], "measured": r["measured"], "predicted": s,
                   "compute": r["compute"], "busiest_link": math.nan, "dilation": r["dilation"], "overrun": None,
                   "wall": None} for r, s in done], path)


if __name__ == "__main__":
    main()
