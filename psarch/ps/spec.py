"""The parameter-server backend, declared (psarch/backend.py): `ps`, with modes sync, async, ssp and geo."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from psarch.backend import PROCESS_GROUP_OPTIONS, BackendSpec
from psarch.config.backend import CoreBackendConfig, Overlap, PSServers, resend_problem
from psarch.config.fields import option
from psarch.errors import ConfigError, show
from psarch.ps.messages import ack_bytes, commit_bytes, pulls_deltas, pushes_from_hooks
from psarch.theory import Prediction


def _theory() -> ModuleType:
    """This backend's theory, imported when first asked: it needs torch, and a spec (read by config checks
    and `psarch keys`) must not."""
    from psarch.ps import theory
    return theory


if TYPE_CHECKING:
    from psarch.cluster.messages import MessageProbe
    from psarch.cluster.placement import Placement
    from psarch.config import Config
    from psarch.records import Summary
    from psarch.trainer import Services


@dataclass(frozen=True)
class PSOptions(PSServers, Overlap, CoreBackendConfig):
    """ps's [backend]: the parameter server's options, its servers' (PSServers) and overlap (pushes from
    backward's hooks); the facts derived from them are properties, computed here only."""

    mode: str = option("sync", "update mode", choices=("sync", "async", "geo", "ssp"))
    k_steps: int = option(4, "local steps between pushes", min=1)
    geo_barrier: bool = option(False, "every round waits for all workers (Local SGD)")
    staleness_bound: int = option(2, "most steps a worker may run ahead of the slowest", min=0)
    staleness_compensation: str = option("none", "remedy for stale gradients", choices=("none", "lr", "dc"))
    dc_lambda: float = option(0.04, "delay-compensation strength (staleness_compensation = 'dc')", min=0.0)
    partition_mb: float | str = option("auto", "each server's range moves and is updated in partitions of this many MiB of "
                                               "the wire dtype, pipelined (a partition's pull is answered once its own "
                                               "round is complete); 0: one message per server each way; 'auto': a 16th "
                                               "of a range, at least 0.6 ms of an emulated cluster's link, at most 4 MiB "
                                               "(4 MiB where the link is not known: psarch/ps/partitions.py)", min=0.0,
                                        named=("auto",))
    partition_assignment: str = option("round_robin", "which partitions each server holds: 'round_robin' (BytePS: "
                                                      "partition j on server j mod k, so every server's partitions are "
                                                      "ready all through backward) or 'ranges' (server i a contiguous 1/k "
                                                      "of the flat vector, in partitions); partition_mb = 0: ranges",
                                       choices=("round_robin", "ranges"))
    priority_credit_mb: float = option(0.0, "ByteScheduler's priority: pushes from backward's hooks leave lowest partition "
                                            "first (the next forward needs it first) with at most this many MiB "
                                            "unacknowledged, and the next forward waits per module for its own "
                                            "partitions' pulls; 0: pushes leave as backward finishes them and the "
                                            "step waits for the whole pull", min=0.0)
    server_addresses: list = option([], "'tcp://host:port' of each server started with `psarch server` "
                                        "(empty: `psarch run` starts the servers itself)")
    replicas: int = option(0, "chain replication (Li et al., OSDI '14): each server's partitions, parameters and "
                              "optimizer state, also kept on the next r servers of a ring; a worker pushes to all of "
                              "them and a round is acknowledged once each has applied it, so a dead server's workers "
                              "go on with its replica (sync only; r < backend.servers)", min=0)

    @property
    def barrier(self) -> bool:
        """Whether a round waits for every live worker's push before it is applied (sync; GEO with a barrier)."""
        return self.mode == "sync" or (self.mode == "geo" and self.geo_barrier)

    @property
    def push_every(self) -> int:
        """Local steps between a worker's exchanges with the servers: k_steps in GEO, else every step."""
        return self.k_steps if self.mode == "geo" else 1

    @property
    def tolerates_lost_workers(self) -> bool:
        """Whether the run goes on without a worker that died: every mode (sync's rounds then go on with the
        N - 1 others, each the mean over the gradients it has: psarch/ps/server/pushes.py)."""
        return True


class PSSpec(BackendSpec):
    kind = "ps"
    trainer = "psarch.ps.worker.trainer:PSWorker"
    doc = "parameter servers over ZeroMQ: workers push gradients (GEO: deltas) and pull parameters"
    options = PSOptions
    variant_key = "mode"
    reads = {**PROCESS_GROUP_OPTIONS, "backend.k_steps": ("geo",), "backend.geo_barrier": ("geo",),
             "backend.staleness_bound": ("ssp",), "backend.staleness_compensation": ("async", "ssp"),
             "backend.dc_lambda": ("async", "ssp"), "cluster.server_link_mbps": None,
             "backend.overlap_comm": ("sync", "async", "ssp")}
    embeddings = ("dense", "rows")
    # pushes cast to 2 bytes, or top-k's (index, value) pairs, summed by the servers in fp32 (GEO: pulls too)
    compressions = ("none", "fp16", "bf16", "topk")
    uncompressed_because = "PowerSGD's two rounds of all-reduce have no PS form built yet"
    # with rows the dense partitions' pushes are compressed, the rows' pushes move whole (GEO: its deltas both ways)
    compressed_embeddings = ("dense", "rows")
    # top-k's error feedback (each worker's) and GEO's copies of what each worker holds (the servers') are in its
    # checkpoints (psarch/ps/snapshot.py)
    checkpoints_compression = True
    # async workers must not be tied together by a group that hangs when one dies
    needs_process_group = False
    trains_subsets = True
    # the servers build their range of what trains from the base checkpoint (psarch/ps/layout.py's initial_flat),
    # the workers their frozen weights (psarch/checkpoint/finetune.py)
    fine_tunes_from_base = True

    def variant(self, cfg: Config) -> str:
        return cfg.backend.mode

    def label(self, cfg: Config) -> str:
        b = cfg.backend
        servers = "1 server" if b.servers == 1 else "N servers" if b.servers == b.world_size else f"{b.servers} servers"
        text = f"ps {b.mode}, {servers}" + (", colocated" if b.server_placement == "colocated" else "")
        if b.partition_mb != "auto":   # the default goes unsaid
            text += ", whole ranges" if not b.partition_mb else f", partitions of {b.partition_mb:g} MiB"
        text += ", ranges" if b.partition_assignment == "ranges" and b.partition_mb else ""   # the default unsaid
        text += f", priority {b.priority_credit_mb:g} MiB" if b.priority_credit_mb else ""
        text += ", pushed after backward" if b.mode != "geo" and not b.overlap_comm else ""
        return text if b.embeddings == "dense" else f"{text}, embeddings {b.embeddings}"

    def lockstep(self, cfg: Config) -> bool:
        return cfg.backend.mode == "sync"

    def check(self, cfg: Config) -> None:
        b = cfg.backend
        if (why := resend_problem(b)) is not None:
            raise ConfigError(why)
        if b.heartbeat_s and b.heartbeat_timeout_s <= b.heartbeat_s:
            raise ConfigError(f"backend.heartbeat_timeout_s = {b.heartbeat_timeout_s:g}: must be longer than "
                              f"backend.heartbeat_s = {b.heartbeat_s:g} (a peer gets at least one PING to answer)")
        if b.server_addresses and (len(b.server_addresses) != b.servers
                                   or not all(isinstance(a, str) and a for a in b.server_addresses)):
            raise ConfigError(f"backend.server_addresses = {show(b.server_addresses)}: expected backend.servers = "
                              f"{b.servers} address strings like \"tcp://10.0.0.5:5555\"")
        if b.server_placement == "colocated" and (b.servers > b.world_size or b.server_addresses):
            raise ConfigError(f"backend.server_placement = \"colocated\" puts server i beside worker i: it needs "
                              f"backend.servers <= backend.world_size (here {b.servers} > {b.world_size})"
                              if not b.server_addresses else
                              "backend.server_placement = \"colocated\" places the servers `psarch run` starts; "
                              "backend.server_addresses names servers started elsewhere")
        if b.priority_credit_mb and not pushes_from_hooks(cfg):
            raise ConfigError(f"backend.priority_credit_mb = {b.priority_credit_mb:g} orders the pushes backward's "
                              f"hooks start: it needs backend.overlap_comm = true, mode sync, async or ssp, "
                              f"precision fp32 or bf16 and dense embeddings (here overlap_comm = "
                              f"{str(b.overlap_comm).lower()}, mode {b.mode!r}, precision "
                              f"{cfg.train.precision!r}, embeddings {b.embeddings!r})")
        if b.embeddings == "rows":
            _check_rows(cfg)
        if b.replicas:
            _check_replicas(cfg)

    def service_nodes(self, cfg: Config) -> int:
        return 0 if cfg.backend.server_addresses else cfg.backend.servers

    def services_hold_the_model(self, cfg: Config) -> bool:
        return True

    def service_beside(self, cfg: Config, index: int) -> int | None:
        return index if cfg.backend.server_placement == "colocated" else None

    def start_services(self, cfg: Config, out_dir: Path, where: "Placement | None" = None,
                       start: Path | None = None) -> "Services":
        from psarch.ps.services import start_services
        return start_services(cfg, out_dir, where=where, start=start)

    def tolerates_lost_workers(self, cfg: Config) -> bool:
        return cfg.backend.tolerates_lost_workers

    def worker_holds_tables(self, cfg: Config) -> bool:
        return cfg.backend.embeddings != "rows"   # the servers build their rows (psarch/ps/rows.py)

    def predict(self, cfg: Config, phi: float) -> Prediction:
        return _theory().rows(cfg, phi) if cfg.backend.embeddings == "rows" else _theory().dense(cfg, phi)

    def program(self, cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
        """psarch/ps/program.py's step, from the servers' partitions (partitions.server_partitions) and placement
        (servers started elsewhere: each a node of its own), each push compressed as train.compression says
        (theory.pushed_bytes); reduced: alike servers grouped (program.groups_of). Sync (and GEO with a barrier):
        a partition's pulls wait for its round. Async and SSP, modelled in steady state with every worker alike:
        a worker's step is its compute and its own exchange, a pull answered once the worker's own push is in
        (no round), the servers' links shared by all workers; SSP's bound never binds workers that keep pace
        (stragglers and staleness are not modelled). GEO: k_steps local steps, then one exchange of deltas, the
        program standing for the k steps. Embedding rows: each worker pulls the rows its batch reads (u expected,
        theory.row_bytes) from every server before it computes (GEO: the rows of its k batches, once) and pushes
        their gradients first after backward; GEO with compression pulls compressed deltas (theory.pulled_bytes).
        Chain replication (backend.replicas = r): each server's held slots, its own and its r predecessors'
        (program.held_slots), exchanged with every worker as its own, and each worker's commit to a partition's
        other holders and their acks (messages.commit_bytes: the run's largest, of its last step and partition and
        its last worker, a few bytes over the others at most). A top-k push's selection is computed on the
        worker as its partition is ready (theory.compressing_bytes at the device's memory bandwidth). Not modelled:
        compressing a GEO pull (the server's), a server's compute."""
        from psarch.ps import program
        from psarch.theory import BYTES, expected_unique_ids

        b, t = cfg.backend, _theory()
        pushed = None if cfg.train.compression == "none" else lambda numel: t.pushed_bytes(cfg, numel)
        pulled = (lambda numel: t.pulled_bytes(cfg, numel)) if pulls_deltas(cfg) else None
        slots = program.slots_of(t.dense_partitions(cfg, phi), BYTES[cfg.train.precision], pushes_from_hooks(cfg),
                                 pushed, pulled, lambda numel: t.compressing_bytes(cfg, numel))
        commits = None
        if b.replicas:   # each partition's exchange with its every holder, and the commits to its followers
            last = max(a for own in t.dense_partitions(cfg, phi) for a, _ in own)
            commits = program.CommitBytes(commit_bytes(b.world_size, cfg.train.steps - 1, last, b.world_size - 1),
                                          ack_bytes(cfg.train.steps))
            slots = program.held_slots(slots, b.replicas)
        colocated = b.server_placement == "colocated" and not b.server_addresses
        if b.embeddings == "rows":   # GEO: the rows its k batches read
            rows = t.row_bytes(expected_unique_ids(cfg, b.push_every), cfg.workload.dlrm.dim,
                               BYTES[cfg.train.precision], b.servers)
        else:
            rows = None
        if reduced:
            return program.ps_reduced(b.world_size, program.groups_of(slots), colocated, step, b.barrier, b.push_every,
                                      rows, commits)
        return program.ps_program(b.world_size, slots, colocated, step, b.barrier, b.push_every, rows, commits)

    def summary_fields(self, cfg: Config) -> Summary:
        return {"servers": cfg.backend.servers}

    def message_probe(self, cfg: Config, phi: float) -> MessageProbe:
        """Pushpulls through a real server with the run's workers and its busiest server's partition count
        (psarch/ps/probe.py)."""
        from psarch.cluster.messages import MessageProbe
        from psarch.ps.partitions import server_partitions
        from psarch.ps.probe import message_s
        held = max(len(p) for p in server_partitions(cfg, int(phi)))
        return MessageProbe("a parameter server's pushpull", message_s,
                            (cfg.backend.world_size, held, cfg.train.optimizer))


def _check_replicas(cfg: Config) -> None:
    """What chain replication (backend.replicas, psarch/ps/README.md) does not do (yet)."""
    b = cfg.backend
    why = None
    if b.replicas >= b.servers:
        why = (f"must be less than backend.servers = {b.servers} (each server's partitions are kept on the next r of "
               f"the other servers of the ring)")
    elif b.mode != "sync":
        why = (f"backend.mode = \"{b.mode}\": replicas are kept for \"sync\" only (a replica is bit for bit its "
               f"primary because both sum a round in worker order; async, ssp and geo apply pushes in arrival order, "
               f"which differs from server to server)")
    elif b.embeddings == "rows":
        why = "backend.embeddings = \"rows\": the rows are not replicated yet"
    elif b.priority_credit_mb:
        why = f"backend.priority_credit_mb = {b.priority_credit_mb:g}: priority's push and pull are not replicated yet"
    elif b.server_addresses:
        why = "backend.server_addresses: replicas are kept by the servers `psarch run` starts"
    elif cfg.train.checkpoint_every:
        why = f"train.checkpoint_every = {cfg.train.checkpoint_every}: a server's checkpoint part holds no replica yet"
    if why:
        raise ConfigError(f"backend.replicas = {b.replicas}: {why}")


def _check_rows(cfg: Config) -> None:
    """What the parameter server's embedding rows (psarch/ps/rows.py) do not do (yet)."""
    b, t = cfg.backend, cfg.train
    why = (f"train.precision = \"{t.precision}\": rows move and are updated in fp32 only (no bf16/fp16 row "
           f"pulls, no loss scaling of pushed rows)" if t.precision != "fp32" else
           f"backend.staleness_compensation = \"{b.staleness_compensation}\": rows are updated without "
           f"compensation" if b.staleness_compensation != "none" else
           f"train.momentum = {t.momentum:g}: row-wise SGD has no momentum (it would move untouched rows)"
           if t.optimizer == "sgd" and t.momentum else
           "backend.server_addresses: `psarch server` does not hold rows" if b.server_addresses else None)
    if why:
        raise ConfigError(f"backend.embeddings = \"rows\" with {why}")


PS = PSSpec()
