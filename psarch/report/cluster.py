"""Step time on an emulated cluster, measured | predicted, for every run of a sweep folder:
`psarch report cluster runs/cluster_crossover` writes cluster.md and step_time.png there."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TypedDict

from psarch import registry
from psarch.config import from_record
from psarch.report.runs import NO_EMULATED_RUN, publish, sweep_rows
from psarch.theory import cluster_step


class ClusterRow(TypedDict):
    """One emulated run of a sweep: its architecture, N, link rate and step times (seconds)."""

    arch: str
    n: int
    mbps: float
    measured: float
    predicted: float
    compute: float
    busiest_link: float          # bytes per step, both ways, of the busiest node's link
    dilation: float | None       # a virtual device's D
    overrun: float | None        # its share of overrun steps
    wall: float | None           # the run's wall clock, seconds (summary's cluster.wall_s; None before it was kept)


def rows(sweep: Path) -> list[ClusterRow]:
    """One row per emulated run under `sweep`: architecture, N, link rate, measured and predicted step time."""
    out: list[ClusterRow] = []
    for f in sorted(sweep.glob("*/summary.json")):
        s = json.loads(f.read_text())
        if not s.get("cluster", {}).get("emulated") or s.get("status", "finished") != "finished":
            continue   # a failed or interrupted run has no step time to set beside theory's (`psarch report runs` lists it)
        cfg = from_record(json.loads((f.parent / "config.json").read_text()))
        b, st = cfg.backend, cluster_step(cfg, s)   # recomputed: the theory of this checkout
        arch = registry.spec_of(cfg).label(cfg)   # the one label of the run's architecture
        busiest = max(n["link_sent"] + n["link_received"] for n in s["cluster"]["nodes"]) / s["steps"]
        vd = s.get("virtual_device")
        out.append({"arch": arch, "n": b.world_size, "mbps": cfg.cluster.link_mbps, "measured": st["measured_s"],
                    "predicted": st["predicted_s"], "compute": st["compute_s"], "busiest_link": busiest,
                    "dilation": vd["dilation"] if vd else None, "overrun": vd["overrun_fraction"] if vd else None,
                    "wall": s["cluster"].get("wall_s")})
    return sorted(out, key=lambda r: (r["mbps"], r["arch"], r["n"]))


def table(rs: list[ClusterRow]) -> str:
    """The markdown table; with virtual devices, compute is the modelled one, and D and the share of
    overrun steps (lockstep: steps; else worker-steps: psarch/cluster/device.py) get their columns; the last,
    each run's wall clock (what the point cost, at its D)."""
    devices = any(r["dilation"] is not None for r in rs)
    extra = " D | overrun steps |" if devices else ""
    lines = [f"| architecture | N | link Mbit/s | step time measured \\| predicted | error | compute "
             f"({'modelled' if devices else 'measured'}) | busiest link per step (both ways) |{extra} wall |",
             "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if devices else "") + "---:|"]
    for r in rs:
        cells = f" {r['dilation']:g} | {r['overrun']:.0%} |" if r["dilation"] is not None else (" | |" if devices else "")
        wall = f" {r['wall']:.0f} s |" if r["wall"] is not None else " |"
        lines.append(f"| {r['arch']} | {r['n']} | {r['mbps']:g} | {r['measured'] * 1e3:.0f} ms \\| "
                     f"{r['predicted'] * 1e3:.0f} ms | {(r['predicted'] / r['measured'] - 1) * 100:+.0f}% | "
                     f"{r['compute'] * 1e3:.0f} ms | {r['busiest_link'] / 1e6:.1f} MB |{cells}{wall}")
    return "\n".join(lines) + "\n"


LOG_SPAN = 3.0   # a panel's largest step time over its smallest beyond which its axis is logarithmic


def plot(rs: list[ClusterRow], path: Path) -> None:
    """Step time against N per architecture and link rate: measured (solid), predicted (dashed); one colour
    and marker per architecture, named once in a legend beside the panels. A panel whose step times span more
    than LOG_SPAN (a 1-server PS beside the ring) is drawn on a log scale, so the close lines stay apart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    rates = sorted({r["mbps"] for r in rs})
    archs = sorted({r["arch"] for r in rs})
    # get_cmap is typed as returning a Colormap; tab20 is a ListedColormap, whose colors are RGB tuples
    colours, markers = plt.get_cmap("tab20").colors, "osD^v<>pPX*h"  # type: ignore[attr-defined]
    style = {arch: dict(color=colours[(2 * i) % 20 + (2 * i) // 20 % 2], marker=markers[i % len(markers)])
             for i, arch in enumerate(archs)}
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates) + 4, 4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for arch in archs:
            pts = [r for r in rs if r["arch"] == arch and r["mbps"] == rate]
            n = [r["n"] for r in pts]
            ax.plot(n, [r["measured"] for r in pts], "-", **style[arch])
            ax.plot(n, [r["predicted"] for r in pts], "--", alpha=0.6, markerfacecolor="none", **style[arch])
        times = [t for r in rs if r["mbps"] == rate for t in (r["measured"], r["predicted"])]
        if max(times) > LOG_SPAN * min(times):
            ax.set_yscale("log")
            ax.set_yticks([t * 10.0**e for e in range(-3, 3) for t in (1, 1.5, 2, 3, 5, 7)
                           if min(times) / 1.2 <= t * 10.0**e <= max(times) * 1.2])
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set(title=f"{rate:g} Mbit/s links", xlabel="workers N", ylabel="step time (s)")
        ax.set_xticks(sorted({r["n"] for r in rs}))
    handles = [Line2D([], [], linestyle="-", **style[a]) for a in archs]
    handles += [Line2D([], [], color="grey", linestyle="-"), Line2D([], [], color="grey", linestyle="--")]
    fig.legend(handles, archs + ["measured", "predicted (theory)"], loc="center left", bbox_to_anchor=(1.0, 0.5),
               fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    """`psarch report cluster SWEEP`: write cluster.md and step_time.png in the sweep folder, print the table."""
    ap = argparse.ArgumentParser(prog="psarch report cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path, help="a sweep folder of runs on an emulated cluster")
    folder = ap.parse_args(argv).sweep
    found = sweep_rows(folder, rows, NO_EMULATED_RUN)
    plot(found, folder / "step_time.png")
    publish(folder, "cluster.md", table(found))
    return 0
