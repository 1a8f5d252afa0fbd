"""The crossover table of the cluster_crossover studies: each PS run's step time over that of the ring DDP
run at the same N and link rate, measured and predicted, beside BytePS's bound for its k servers (Jiang et al.,
OSDI '20: t = 2N(N-1)S / ((N^2 + kN - 2k)·B) over all-reduce's 2(N-1)S/(NB), i.e. N^2 / (N^2 + kN - 2k); k
colocated servers add no machine: the bound is all-reduce's, 1). `psarch report crossover SWEEP` writes
crossover.md in the sweep folder and prints it."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TypedDict

from psarch import registry
from psarch.config import Config, from_record
from psarch.ps.theory import byteps_optimum
from psarch.report.runs import NO_EMULATED_RUN, publish, sweep_rows
from psarch.theory import cluster_step


def bound(n: int, k: int, colocated: bool) -> float:
    """BytePS's optimum over all-reduce's time at N workers with k more (CPU) servers; colocated: k = 0."""
    ring = 2 * (n - 1) / n
    return byteps_optimum(n, 0 if colocated else k, 1.0, 1.0) / ring


class CrossoverRun(TypedDict):
    """One emulated run: its config, its architecture's label and theory.cluster_step's step times."""

    cfg: Config
    label: str
    measured_s: float
    predicted_s: float
    compute_s: float
    predicted_comm_s: float


def runs(sweep: Path) -> list[CrossoverRun]:
    """Every emulated run under `sweep`: its config, label and measured | predicted step time."""
    out: list[CrossoverRun] = []
    for f in sorted(sweep.glob("*/summary.json")):
        s = json.loads(f.read_text())
        if s.get("cluster", {}).get("emulated"):
            cfg = from_record(json.loads((f.parent / "config.json").read_text()))
            st = cluster_step(cfg, s)
            out.append({"cfg": cfg, "label": registry.spec_of(cfg).label(cfg), "measured_s": st["measured_s"],
                        "predicted_s": st["predicted_s"], "compute_s": st["compute_s"],
                        "predicted_comm_s": st["predicted_comm_s"]})
    return out


def table(found: list[CrossoverRun]) -> str:
    """Each run with servers that hold the model (BackendSpec.service_nodes, services_hold_the_model) against its ring
    peer, the run at the same N and link rate
    whose step is a ring all-reduce (BackendSpec.all_reduce), and the all-reduce runs themselves; rows without a
    peer show '-', runs of neither kind are left out."""
    def key(r: CrossoverRun) -> tuple[int, float]:
        return r["cfg"].backend.world_size, r["cfg"].cluster.link_mbps

    def all_reduce(r: CrossoverRun) -> str | None:
        return registry.spec_of(r["cfg"]).all_reduce(r["cfg"])

    def servers(r: CrossoverRun) -> tuple[int, bool]:
        """(k servers, whether they share the workers' nodes)"""
        spec, cfg = registry.spec_of(r["cfg"]), r["cfg"]
        k = spec.service_nodes(cfg) if spec.services_hold_the_model(cfg) else 0   # not a hybrid's tables
        return k, k > 0 and spec.service_beside(cfg, 0) is not None
    ring = {key(r): r for r in found if all_reduce(r) == "ring"}
    lines = ["| link Mbit/s | N | architecture | step time measured \\| predicted | error | PS/ring measured \\| "
             "predicted | BytePS bound |", "|---:|---:|---|---:|---:|---:|---:|"]
    for r in sorted(found, key=lambda r: (key(r)[1], key(r)[0], all_reduce(r) is None, r["label"])):
        (k, colocated), peer = servers(r), ring.get(key(r))
        ratio, ref = "-", "-"
        if k and peer is not None:
            ratio = f"{r['measured_s'] / peer['measured_s']:.2f} \\| {r['predicted_s'] / peer['predicted_s']:.2f}"
            ref = f"{bound(key(r)[0], k, colocated):.2f}"
        elif not k and all_reduce(r) is None:
            continue
        lines.append(f"| {key(r)[1]:g} | {key(r)[0]} | {r['label']} | {r['measured_s'] * 1e3:.0f} ms \\| "
                     f"{r['predicted_s'] * 1e3:.0f} ms | {(r['predicted_s'] / r['measured_s'] - 1) * 100:+.0f}% | "
                     f"{ratio} | {ref} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`psarch report crossover SWEEP`: write crossover.md in the sweep folder and print it."""
    ap = argparse.ArgumentParser(prog="psarch report crossover", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path, help="the sweep folder of a cluster_crossover study")
    folder = ap.parse_args(argv).sweep
    publish(folder, "crossover.md", table(sweep_rows(folder, runs, NO_EMULATED_RUN)))
    return 0
