"""`psarch estimate`: the analytic model, no processes.

Memory per device for DDP and ZeRO 1-3 (the ZeRO paper's Tables 1 and 2), traffic per step for every
architecture, and an alpha-beta step-time model from 1 to 1,024 workers. GB here is 1e9 bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from psarch import registry, theory
from psarch.config import Config
from psarch.estimate_tensor import GPTShape, tensor_report

STAGES = (("ddp", 0), ("zero-1", 1), ("zero-2", 2), ("zero-3", 3))


def _setup(stage: int, n: int, precision: str, optimizer: str) -> Config:
    """DDP (stage 0) or ZeRO-`stage` at world size n."""
    return theory.config_for("zero", n, precision, optimizer, stage=stage) if stage else \
        theory.config_for("ddp", n, precision, optimizer)


def memory_table(phi: float, worlds: list[int], precision: str = "bf16", optimizer: str = "adamw") -> list[dict]:
    """Model-state bytes per device for DDP and ZeRO stages 1-3 at each world size (ZeRO paper Table 1)."""
    return [{"world": n, **{name: theory.predict(_setup(stage, n, precision, optimizer), phi).memory_per_rank.total
                            for name, stage in STAGES}} for n in worlds]


def max_params(budget_bytes: float, world: int, stage: int, precision: str = "bf16", optimizer: str = "adamw") -> float:
    """The largest Φ whose model states fit in `budget_bytes` per device at data-parallel degree `world`."""
    return budget_bytes / theory.predict(_setup(stage, world, precision, optimizer), 1.0).memory_per_rank.total


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


def comm_time(p: theory.Prediction, c: Cluster) -> float:
    """Seconds of communication per step from a prediction's per-link bytes and messages. A ring sends
    and receives at once, so a worker's link time is its bytes sent; a PS pushes, then pulls, each phase
    bounded by the busier end (a worker's link or a server's, which carries every worker's share)."""
    if p.server is None:
        return p.messages * c.alpha + p.worker.sent / c.bandwidth
    push = max(p.worker.sent, p.server.received)
    pull = max(p.worker.received, p.server.sent)
    return p.messages * c.alpha + (push + pull) / c.bandwidth


def step_time(p: theory.Prediction, c: Cluster) -> float:
    """Compute plus the communication that compute does not hide."""
    comm = comm_time(p, c)
    return c.compute_s + comm - min(c.overlap * comm, c.compute_s)


def _ps(phi: float, precision: str, n: int, servers: str) -> theory.Prediction:
    count = n if servers == "n" else int(servers)
    return theory.predict(theory.config_for("ps", n, precision, "adamw", servers=count), phi)


def scaling_table(phi: float, precision: str, c: Cluster, worlds: list[int], ps_servers: list[str]) -> list[dict]:
    """Step time for each architecture and N (weak scaling: compute per worker stays c.compute_s).

    ps_servers entries are counts ("4") or "n" (as many servers as workers)."""
    rows = []
    for n in worlds:
        row = {"world": n, "ring": step_time(theory.predict(_setup(0, n, precision, "adamw"), phi), c),
               "zero-3": step_time(theory.predict(_setup(3, n, precision, "adamw"), phi), c)}
        for s in ps_servers:
            row[f"ps/{s}"] = step_time(_ps(phi, precision, n, s), c)
        rows.append(row)
    return rows


def crossover(phi: float, precision: str, c: Cluster, servers: str, worlds: list[int]) -> int | None:
    """The smallest N at which the PS with `servers` servers steps faster than ring all-reduce."""
    for n in worlds:
        ddp = theory.predict(_setup(0, n, precision, "adamw"), phi)
        if n > 1 and step_time(_ps(phi, precision, n, servers), c) < step_time(ddp, c):
            return n
    return None


def measured_compute(summary: dict) -> float:
    """A run's compute time per step: its median step time less the time it waited on communication."""
    return max(summary["step_time_s"] - summary.get("comm_s", 0.0), 0.0)


# ---------------------------------------------------------------- printing

WORLDS = [1, 4, 16, 64, 256, 1024]


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g}" if x < 1e11 else f"{x / 1e9:.0f}"


def _params(x: float) -> str:
    return f"{x / 1e12:.3g}T" if x >= 1e12 else f"{x / 1e9:.4g}B"


def backend_rows(phi: float, world: int, precision: str, optimizer: str, options: dict) -> list[str]:
    """The rows backends add from Φ alone for the command line's options (BackendSpec.estimate_rows)."""
    rows = [r for spec in registry.specs() for r in spec.estimate_rows(phi, world, precision, optimizer, options)]
    if not rows:
        return []
    out = ["", f"== model parallelism at N = {world}: model states per device, gradient all-reduce per device, "
               f"idle fraction", f"{'architecture':>40} {'states GB':>10} {'sends GB':>10} {'bubble':>7}"]
    return out + [f"{r['label']:>40} {_gb(r['states']):>10} {_gb(r['sent']):>10} {r['bubble']:>7.3f}" for r in rows]


def report(phi: float, world: int, precision: str = "bf16", optimizer: str = "adamw", servers: int = 1,
           cluster: Cluster | None = None, budget: float = 32e9, measured: tuple[dict, Config] | None = None,
           compute_from: str | None = None, options: dict | None = None,
           tensor: tuple[GPTShape, int] | None = None) -> str:
    """Everything `psarch estimate` prints; `measured` is a run's (summary, config), compared with the model
    at the end; `compute_from` names the run the cluster's compute time was measured in, if any; `options`
    the backend options asked for on the command line (a pipeline's stages and micro-batches: the rows
    BackendSpec.estimate_rows adds from Φ alone); `tensor` (a GPT's shape, the degree asked for): tensor
    parallelism's rows, which need the shape (psarch.estimate_tensor)."""
    c = cluster or Cluster()
    payload = phi * theory.BYTES[precision]
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
    for label, cfg in (("ddp (ring)", _setup(0, world, precision, optimizer)),
                       ("zero-1/2", _setup(1, world, precision, optimizer)),
                       ("zero-3", _setup(3, world, precision, optimizer)),
                       (f"ps, {servers} server(s)", theory.config_for("ps", world, precision, optimizer, servers=servers))):
        p = theory.predict(cfg, phi)
        srv = p.server or theory.LinkBytes()
        out.append(f"{label:>16} {_gb(p.worker.sent):>13} {_gb(p.worker.received):>13} "
                   f"{_gb(srv.received):>13} {_gb(srv.sent):>13}")
    out += backend_rows(phi, world, precision, optimizer, options or {})
    worlds = [2**k for k in range(11)]
    cols = ["1", str(servers), "n"] if servers not in (1,) else ["1", "n"]
    source = f" (measured in {compute_from})" if compute_from else ""
    out += ["", f"== step time (s), compute {c.compute_s:g} s/step/worker{source} (weak scaling), link "
                f"{c.bandwidth / 1e9:g} GB/s, latency {c.alpha * 1e6:g} us, overlap {c.overlap:g}",
            f"{'N':>6} {'ddp ring':>9} {'zero-3':>9} " + " ".join(f"{'ps/' + s:>9}" for s in cols)
            + "   (ps/n: one server per worker)"]
    for row in scaling_table(phi, precision, c, worlds, cols):
        out.append(f"{row['world']:>6} {row['ring']:>9.4f} {row['zero-3']:>9.4f} "
                   + " ".join(f"{row['ps/' + s]:>9.4f}" for s in cols))
    for s in cols:
        n = crossover(phi, precision, c, s, worlds)
        out.append(f"ps/{s} overtakes ring all-reduce at N = {n}" if n else
                   f"ps/{s} does not overtake ring all-reduce up to N = {worlds[-1]}")
    if tensor:
        out += [""] + tensor_report(tensor[0], world, tensor[1], precision, optimizer)
    if measured:
        out += ["", measured_vs_model(*measured, c)]
    return "\n".join(out) + "\n"


def measured_vs_model(summary: dict, cfg: Config, c: Cluster) -> str:
    """A run's measured step time and traffic against the model's for the run's own config, with compute
    taken from the run."""
    compute = measured_compute(summary)
    p = theory.predict(cfg, summary["params"])
    model = step_time(p, Cluster(c.bandwidth, c.alpha, compute, c.overlap))
    sent = [r["sent_per_step"] for r in summary["traffic"]["per_rank"]]
    variant = summary.get("variant", "")
    return (f"== measured run {summary['name']} ({summary['backend']} {variant}, N = {summary['world_size']}): "
            f"compute {compute * 1e3:.2f} ms\n"
            f"step time  measured {summary['step_time_s'] * 1e3:.2f} ms   model {model * 1e3:.2f} ms\n"
            f"sent/step  measured {sum(sent) / len(sent):,.0f} B   model {p.worker.sent:,.0f} B")
