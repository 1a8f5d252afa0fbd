"""`psarch estimate`'s step times: each architecture's step program (BackendSpec.program, reduced: every rank
alike) played by the step simulator (psarch.theory.simulate) on a cluster of equal links, at any N, weak
scaling (each worker computes the same step at every N)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psarch import registry, theory
from psarch.config import Config, ConfigError, option_keys
from psarch.theory.program import Cluster, DataStep
from psarch.theory.simulate import StepTime, simulate

RING = "ddp ring"


@dataclass
class Network:
    """Every node's link (bytes/s each way) and latency per message, and a worker's compute per step."""

    bandwidth: float = 12.5e9     # 100 Gb/s
    alpha: float = 10e-6
    compute_s: float = 0.1        # forward + backward (backward 2/3 of it)
    overlap: bool = True          # buckets and partitions sent from backward's hooks (backend.overlap_comm)


# the hybrid (backend.embeddings = "ps"): the tables' rows on a PS server beside each worker, the dense part
# all-reduced (ddp) or sharded (ZeRO-3)
HYBRID = {"embeddings": "ps", "servers": "n", "server_placement": "colocated"}


def architectures(servers: int, tables: bool = False) -> dict[str, tuple[str, dict[str, Any]]]:
    """The columns of the step-time table: label -> (backend.kind, its options; servers "n": one per worker);
    `tables`: the model has embedding tables, and the hybrid's columns are added."""
    out: dict[str, tuple[str, dict[str, Any]]] = {
        RING: ("ddp", {}), "zero-1": ("zero", {"stage": 1}), "zero-2": ("zero", {"stage": 2}),
        "zero-3": ("zero", {"stage": 3}), "ps/1": ("ps", {"servers": 1})}
    if servers > 1:
        out[f"ps/{servers}"] = ("ps", {"servers": servers})
    out["ps/n"] = ("ps", {"servers": "n"})
    out["ps/n col"] = ("ps", {"servers": "n", "server_placement": "colocated"})
    if tables:
        out["ddp+ps/n"] = ("ddp", HYBRID)
        out["zero-3+ps/n"] = ("zero", {"stage": 3, **HYBRID})
    return out


def has_tables(workload: dict[str, Any] | None) -> bool:
    """Whether the model of a config's [workload] section has embedding tables (the built-in DLRM's)."""
    return (workload or {}).get("model") == "dlrm"


def config(kind: str, options: dict[str, Any], n: int, precision: str, net: Network,
           extra: dict[str, Any] | None = None, workload: dict[str, Any] | None = None, per_rank: int = 1,
           optimizer: str = "adamw") -> Config:
    """The config of one cell: `options` at world size n (servers "n": n), and of `extra` the backend options
    this backend reads (e.g. the PS's partition_mb); `workload`: the model asked about (whose units ZeRO-3 gathers),
    as a config's [workload] section; `per_rank`: its samples per worker a step."""
    opts = {k: (n if v == "n" else v) for k, v in options.items()}
    cfg = theory.config_for(kind, n, precision, optimizer, workload=workload, per_rank=per_rank,
                            overlap_comm=net.overlap, **opts)
    own = option_keys(registry.spec_of(cfg))
    reads = {k: v for k, v in (extra or {}).items() if f"backend.{k}" in own}
    return theory.config_for(kind, n, precision, optimizer, workload=workload, per_rank=per_rank,
                             overlap_comm=net.overlap, **opts, **reads) if reads else cfg


def simulated(cfg: Config, phi: float, net: Network, reduced: bool = True) -> StepTime:
    """The simulated step of `cfg`'s backend with Φ = phi on `net` (a ConfigError where it has no program)."""
    program = registry.spec_of(cfg).program(cfg, phi, DataStep.of(net.compute_s), reduced)
    if program is None:
        raise no_program(cfg)
    return simulate(program, Cluster.of(program, net.bandwidth, net.alpha))


def no_program(cfg: Config) -> Exception:
    """The one-line error for a backend whose step has no program yet."""
    from psarch.errors import ConfigError

    return ConfigError(f"{registry.spec_of(cfg).label(cfg)}: no step program is written for it yet "
                       f"(BackendSpec.program), so the simulator cannot time its step")


def scaling_table(phi: float, precision: str, net: Network, worlds: list[int], servers: int = 1,
                  extra: dict[str, Any] | None = None, workload: dict[str, Any] | None = None,
                  per_rank: int = 1, optimizer: str = "adamw") -> list[dict[str, float]]:
    """Step seconds of each architecture (accepted(...)) at each N; `extra`: backend options, each for the
    backends that read it (e.g. the PS's partition_mb); `workload`: the model asked about (config's); `per_rank`:
    its samples per worker a step."""
    cells = accepted(precision, net, servers, extra, workload, per_rank, optimizer)[0]
    return [{"world": n, **{label: simulated(config(kind, opts, n, precision, net, extra, workload, per_rank,
                                                    optimizer), phi, net).step_s
                            for label, (kind, opts) in cells.items()}} for n in worlds]


def accepted(precision: str, net: Network, servers: int = 1, extra: dict[str, Any] | None = None,
             workload: dict[str, Any] | None = None, per_rank: int = 1,
             optimizer: str = "adamw") -> tuple[dict[str, tuple[str, dict[str, Any]]], dict[str, str]]:
    """The architectures (architectures(servers, tables: the model's)) whose config their backend accepts for the
    model asked about, and the one-line reason of each it refuses (the hybrid's rows move in fp32 only)."""
    cells, refused = {}, {}
    for label, (kind, opts) in architectures(servers, has_tables(workload)).items():
        try:
            config(kind, opts, 2, precision, net, extra, workload, per_rank, optimizer)
        except ConfigError as e:
            refused[label] = str(e)
            continue
        cells[label] = (kind, opts)
    return cells, refused


def crossover(rows: list[dict[str, float]], label: str) -> int | None:
    """The smallest N > 1 of the table at which `label` steps faster than ring all-reduce."""
    return next((int(r["world"]) for r in rows if r["world"] > 1 and r[label] < r[RING]), None)
