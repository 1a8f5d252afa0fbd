"""`psarch estimate`: the analytic model, no processes.

Memory per device for DDP and ZeRO 1-3 (the ZeRO paper's Tables 1 and 2), traffic per step for every
architecture, and an alpha-beta step-time model from 1 to 1,024 workers. GB here is 1e9 bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from psarch import theory

STAGES = (("ddp", 0), ("zero-1", 1), ("zero-2", 2), ("zero-3", 3))


def memory_table(phi: float, worlds: list[int], precision: str = "bf16", optimizer: str = "adamw") -> list[dict]:
    """Model-state bytes per device for DDP and ZeRO stages 1-3 at each world size (ZeRO paper Table 1)."""
    rows = []
    for n in worlds:
        row = {"world": n}
        for name, stage in STAGES:
            kind = "zero" if stage else "ddp"
            row[name] = theory.memory_per_rank(kind, phi, n, precision, optimizer, stage=stage).total
        rows.append(row)
    return rows


def max_params(budget_bytes: float, world: int, stage: int, precision: str = "bf16", optimizer: str = "adamw") -> float:
    """The largest Φ whose model states fit in `budget_bytes` per device at data-parallel degree `world`."""
    kind = "zero" if stage else "ddp"
    per_param = theory.memory_per_rank(kind, 1.0, world, precision, optimizer, stage=stage).total
    return budget_bytes / per_param


def table2(budget_bytes: float = 32e9, gpus: tuple[int, ...] = (64, 128, 256, 512, 1024), dp: int = 64) -> list[dict]:
    """ZeRO paper Table 2: the largest model for a per-GPU budget, model parallelism MP = gpus / dp.

    As the paper does, the MP = 1 size is cut to 0.1 B parameters and scaled by MP (model parallelism
    splits each layer evenly over MP devices)."""
    rows = []
    for g in gpus:
        mp = g // dp
        row = {"mp": mp, "gpus": g}
        for name, stage in STAGES:
            row[name] = math.floor(max_params(budget_bytes, dp, stage) / 1e8) * 1e8 * mp
        rows.append(row)
    return rows


@dataclass
class Cluster:
    """alpha-beta model of a link: a message of b bytes takes alpha + b / bandwidth seconds."""

    bandwidth: float = 12.5e9     # bytes/s per direction per device (100 Gb/s)
    alpha: float = 10e-6          # seconds of latency per message
    compute_s: float = 0.1        # forward + backward + update per step per worker (weak scaling)
    overlap: float = 0.0          # fraction of communication hidden behind compute


def comm_time(kind: str, payload: float, n: int, c: Cluster, stage: int = 0, servers: int = 1) -> float:
    """Seconds of communication per step. Ring collectives: 2(N-1) (stage 3: 3(N-1)) messages of S/N;
    PS: a push then a pull, each bounded by the busier end: a worker's S or a server's N*S/servers."""
    if n == 1 and kind != "ps":
        return 0.0
    if kind == "ps":
        busiest = max(payload, n * payload / servers)
        return 2 * (c.alpha + busiest / c.bandwidth)
    rounds = 3 if (kind == "zero" and stage == 3) else 2
    return rounds * (n - 1) * (c.alpha + payload / n / c.bandwidth)


def step_time(kind: str, payload: float, n: int, c: Cluster, stage: int = 0, servers: int = 1) -> float:
    comm = comm_time(kind, payload, n, c, stage, servers)
    return c.compute_s + comm - min(c.overlap * comm, c.compute_s)


def scaling_table(payload: float, c: Cluster, worlds: list[int], ps_servers: list[str]) -> list[dict]:
    """Step time and samples/s relative to one worker, for each architecture and N.

    ps_servers entries are counts ("4") or "n" (as many servers as workers)."""
    rows = []
    for n in worlds:
        row = {"world": n, "ddp": step_time("ddp", payload, n, c), "zero-3": step_time("zero", payload, n, c, 3)}
        for s in ps_servers:
            servers = n if s == "n" else int(s)
            row[f"ps/{s}"] = step_time("ps", payload, n, c, servers=servers)
        rows.append(row)
    return rows


def crossover(payload: float, c: Cluster, servers: str, worlds: list[int]) -> int | None:
    """The smallest N at which the PS with `servers` servers steps faster than ring all-reduce."""
    for n in worlds:
        s = n if servers == "n" else int(servers)
        if n > 1 and step_time("ps", payload, n, c, servers=s) < step_time("ddp", payload, n, c):
            return n
    return None


# ---------------------------------------------------------------- printing

WORLDS = [1, 4, 16, 64, 256, 1024]


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g}" if x < 1e11 else f"{x / 1e9:.0f}"


def _params(x: float) -> str:
    return f"{x / 1e12:.3g}T" if x >= 1e12 else f"{x / 1e9:.4g}B"


def report(phi: float, world: int, precision: str = "bf16", optimizer: str = "adamw", servers: int = 1,
           cluster: Cluster | None = None, budget: float = 32e9, measured: dict | None = None) -> str:
    """Everything `psarch estimate` prints."""
    c = cluster or Cluster()
    wire = theory.BYTES[precision]
    payload = phi * wire
    out = [f"== model states per device, GB (1e9 bytes): Φ = {_params(phi)}, {precision} + {optimizer} "
           f"(K = {theory.optimizer_bytes_per_param(optimizer, precision)})",
           f"{'N':>6} " + " ".join(f"{name:>10}" for name, _ in STAGES)]
    for row in memory_table(phi, sorted(set(WORLDS + [world])), precision, optimizer):
        mark = "  <- --world" if row["world"] == world else ""
        out.append(f"{row['world']:>6} " + " ".join(f"{_gb(row[name]):>10}" for name, _ in STAGES) + mark)
    out += ["", f"== largest model per device budget {_gb(budget)} GB, DP = 64 (ZeRO paper Table 2)",
            f"{'MP':>4} {'GPUs':>6} " + " ".join(f"{name:>10}" for name, _ in STAGES)]
    for row in table2(budget):
        out.append(f"{row['mp']:>4} {row['gpus']:>6} " + " ".join(f"{_params(row[name]):>10}" for name, _ in STAGES))
    out += ["", f"== traffic per step at N = {world} (S = {_gb(payload)} GB of {precision} gradients)",
            f"{'architecture':>16} {'worker sends':>13} {'worker recvs':>13} {'server recvs':>13} {'server sends':>13}"]
    for label, kind, stage in (("ddp (ring)", "ddp", 0), ("zero-1/2", "zero", 1), ("zero-3", "zero", 3),
                               (f"ps, {servers} server(s)", "ps", 0)):
        t = theory.traffic_per_step(kind, payload, world, stage, servers)
        out.append(f"{label:>16} {_gb(t['worker_sent']):>13} {_gb(t['worker_received']):>13} "
                   f"{_gb(t.get('server_received', 0)):>13} {_gb(t.get('server_sent', 0)):>13}")
    worlds = [2**k for k in range(11)]
    cols = ["1", str(servers), "n"] if servers not in (1,) else ["1", "n"]
    out += ["", f"== step time (s), compute {c.compute_s:g} s/step/worker (weak scaling), link "
                f"{c.bandwidth / 1e9:g} GB/s, latency {c.alpha * 1e6:g} us, overlap {c.overlap:g}",
            f"{'N':>6} {'ddp':>9} {'zero-3':>9} " + " ".join(f"{'ps/' + s:>9}" for s in cols)
            + "   (ps/n: one server per worker)"]
    for row in scaling_table(payload, c, worlds, cols):
        out.append(f"{row['world']:>6} {row['ddp']:>9.4f} {row['zero-3']:>9.4f} "
                   + " ".join(f"{row['ps/' + s]:>9.4f}" for s in cols))
    for s in cols:
        n = crossover(payload, c, s, worlds)
        out.append(f"ps/{s} overtakes ring all-reduce at N = {n}" if n else
                   f"ps/{s} does not overtake ring all-reduce up to N = {worlds[-1]}")
    if measured:
        out += ["", measured_vs_model(measured, c)]
    return "\n".join(out) + "\n"


def measured_vs_model(summary: dict, c: Cluster) -> str:
    """A run's measured step time and traffic against the model's, with compute taken from the run."""
    n, kind, stage = summary["world_size"], summary["backend"], 0
    variant = summary.get("variant", "")
    if kind == "zero":
        stage = int(variant.split("/")[0].removeprefix("stage"))
    kind = {"torch_ddp": "ddp", "torch_zero": "ddp", "torch_fsdp": "zero"}.get(kind, kind)
    payload = summary["params"] * theory.BYTES[summary.get("precision", "fp32")]
    compute = max(summary["step_time_s"] - summary.get("comm_s", 0.0), 0.0)
    model = Cluster(c.bandwidth, c.alpha, compute, c.overlap)
    predicted = step_time(kind, payload, n, model, stage, max(1, summary.get("servers", 1))) \
        if kind != "single" else compute
    sent = [r["sent_per_step"] for r in summary["traffic"]["per_rank"]]
    pred_t = summary["predicted"]["traffic_per_step"]["worker_sent"]
    return (f"== measured run {summary['name']} ({summary['backend']} {variant}, N = {n}): compute {compute * 1e3:.2f} ms\n"
            f"step time  measured {summary['step_time_s'] * 1e3:.2f} ms   model {predicted * 1e3:.2f} ms\n"
            f"sent/step  measured {sum(sent) / len(sent):,.0f} B   model {pred_t:,.0f} B")
