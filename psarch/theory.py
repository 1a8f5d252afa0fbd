"""What theory predicts for a run, in one place: `predict(cfg, phi)`.

Memory per rank by category (ZeRO paper, Rajbhandari et al. 2020), bytes per step on each worker's and
each server's link, communication rounds per step, and a PS server's memory. Every output beside a
measured figure (`outputs`, `compare`, `estimate`) calls `predict`; nothing patches its result afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psarch.config import BackendConfig, Config, TrainConfig
from psarch.data.clicks import expected_unique

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def optimizer_bytes_per_param(optimizer: str, precision: str, momentum: float = 0.0) -> int:
    """K in the ZeRO paper: optimizer state per parameter, fp32 master copy included where kept."""
    state = {"adamw": 8, "adagrad": 4}.get(optimizer, 4 if momentum > 0 else 0)
    return state + (0 if precision == "fp32" else 4)


@dataclass
class MemoryPrediction:
    params: float
    grads: float
    optimizer: float
    buffers: float = 0.0     # model state outside the three categories (a GEO worker's last synced copy)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.buffers

    def to_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "buffers": self.buffers, "total": self.total}


@dataclass
class LinkBytes:
    """Bytes one node's link carries per step, each way (mean over steps)."""

    sent: float = 0.0
    received: float = 0.0


@dataclass
class Prediction:
    """Everything theory says about one run. `worker` and `server` are per-link figures, the input of a
    step-time model on a cluster (one link per worker, one per PS server)."""

    memory_per_rank: MemoryPrediction   # model states one worker holds
    worker: LinkBytes                   # one worker's link, per step
    server: LinkBytes | None            # one PS server's link, per step (None: no servers)
    rounds: float                       # communication phases per step: a collective pass, a push or a pull
    messages: float                     # messages in sequence per step, each paying the link latency once
    server_memory: float | None         # bytes one PS server holds (None: no servers)

    def to_dict(self) -> dict:
        """The `predicted` entry of summary.json."""
        traffic = {"worker_sent": self.worker.sent, "worker_received": self.worker.received}
        if self.server is not None:
            traffic.update(server_sent=self.server.sent, server_received=self.server.received)
        out = {"memory_per_rank": self.memory_per_rank.to_dict(), "traffic_per_step": traffic,
               "rounds_per_step": self.rounds, "messages_per_step": self.messages}
        if self.server_memory is not None:
            out["server_memory"] = self.server_memory
        return out


# Which algorithm each collective kind runs: (ZeRO stage for memory, 0 = replicated; ring passes per step).
# The PyTorch peers are named here and nowhere else: torch_zero is DDP's full all-reduce (2 passes) plus
# ZeroRedundancyOptimizer's broadcast of each updated shard (an all-gather's volume, 1 pass) over ZeRO-1
# memory; torch_fsdp (FSDP2) is ZeRO-3: all-gather in forward, again in backward, reduce-scatter.
COLLECTIVES = {"single": (0, 0), "ddp": (0, 2), "torch_ddp": (0, 2), "torch_zero": (1, 3), "torch_fsdp": (3, 3)}


def _collective(b: BackendConfig) -> tuple[int, int]:
    if b.kind == "zero":
        return b.stage, 3 if b.stage == 3 else 2
    if b.kind not in COLLECTIVES:
        raise ValueError(f"backend.kind = {b.kind!r}: unknown backend kind; theory knows {', '.join([*COLLECTIVES, 'zero', 'ps'])}")
    return COLLECTIVES[b.kind]


def predict(cfg: Config, phi: float) -> Prediction:
    """What theory predicts for `cfg` with `phi` parameters. S = phi x the wire dtype's bytes (the
    compute precision), N = backend.world_size."""
    b, t = cfg.backend, cfg.train
    n, width = b.world_size, BYTES[t.precision]
    s = phi * width
    k = optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
    if b.kind == "ps" and b.embeddings == "rows":
        return _ps_rows(cfg, phi)
    if b.kind == "ps":
        # each worker pushes S (gradients; GEO: deltas) and pulls S, split evenly over the servers;
        # GEO does so once every k_steps steps and keeps a local optimizer and the last synced fp32 model
        every = b.k_steps if b.mode == "geo" else 1
        per_server = n * s / b.servers / every
        # a server holds its fp32 range and, except in GEO (deltas are added), the optimizer state for it;
        # barrier modes sum a round's pushes in an fp32 accumulator; delay compensation keeps the version
        # last sent to each worker. Not counted: the pushes a barrier server keeps while it waits for a
        # predecessor's (it sums in worker order): none at a round's end, at worst (N - 1) x width x its
        # range mid-round (worker 0 last); how many depends on arrival order, so servers report their peak
        server_per_param = 4 + (0 if b.mode == "geo" else optimizer_bytes_per_param(t.optimizer, "fp32", t.momentum))
        server_per_param += 4 if b.mode == "sync" or (b.mode == "geo" and b.geo_barrier) else 0
        server_per_param += 4 * n if b.mode in ("async", "ssp") and b.staleness_compensation == "dc" else 0
        server_mem = server_per_param * phi / b.servers
        if b.mode == "geo":
            mem = MemoryPrediction(params=width * phi, grads=width * phi, optimizer=k * phi, buffers=4 * phi)
        else:
            mem = MemoryPrediction(params=width * phi, grads=width * phi, optimizer=0.0)
        return Prediction(mem, LinkBytes(s / every, s / every), LinkBytes(per_server, per_server),
                          rounds=2 / every, messages=2 / every, server_memory=server_mem)
    stage, passes = _collective(b)
    if b.kind == "ddp" and b.embeddings == "sharded":
        return _sharded(cfg, phi, k)
    if b.embeddings == "rows":
        return _rows(cfg, phi, k)
    mem = MemoryPrediction(params=width * phi / n if stage >= 3 else width * phi,
                           grads=width * phi / n if stage >= 2 else width * phi,
                           optimizer=k * phi / n if stage >= 1 else k * phi)
    if n == 1 or passes == 0:
        return Prediction(mem, LinkBytes(), None, rounds=0, messages=0, server_memory=None)
    # a ring pass is N - 1 messages of S/N each way: (N - 1)/N x S per pass per worker
    v = passes * (n - 1) / n * s
    return Prediction(mem, LinkBytes(v, v), None, rounds=passes, messages=passes * (n - 1), server_memory=None)


def sharded_bytes(ids_out: float, ids_in: float, tables: int, dim: int, width: int, n: int) -> tuple[float, float]:
    """(sent, received) bytes of one rank's all-to-alls in a step with row-sharded tables (collective/sharded.py),
    from their definitions: the id counts (int64, one per table to each other rank), the ids it asks other
    owners for (8 B each, `ids_out`) and the rows they answer (dim x width each), the rows it answers for the
    `ids_in` ids others ask of it, then in backward the gradients of the rows it fetched out to their owners
    and of its own rows in."""
    counts = 8 * tables * (n - 1)
    row = dim * width
    return (counts + 8 * ids_out + row * ids_in + row * ids_out,
            counts + 8 * ids_in + row * ids_out + row * ids_in)


def _sharded(cfg: Config, phi: float, k: int) -> Prediction:
    """ddp with sharded tables: each rank holds ceil(rows/N) rows of every table (padding included) beside the
    whole dense part, all-reduces the dense gradients by ring, and moves rows by all-to-all. A rank's ids per
    table are u = E[distinct ids] of its global_batch/N x bag Zipf draws, of which (N-1)/N live elsewhere."""
    n, width, d = cfg.backend.world_size, BYTES[cfg.train.precision], cfg.workload.dlrm
    dense = phi - d.num_tables * d.rows * d.dim
    held = dense + d.num_tables * -(-d.rows // n) * d.dim
    mem = MemoryPrediction(params=width * held, grads=width * held, optimizer=k * held)
    if n == 1:
        return Prediction(mem, LinkBytes(), None, rounds=0, messages=0, server_memory=None)
    u = expected_unique_ids(cfg)
    sent, received = sharded_bytes(u * (n - 1) / n, u * (n - 1) / n, d.num_tables, d.dim, width, n)
    ring = 2 * (n - 1) / n * dense * width
    # two ring passes of N - 1 messages in sequence; each all-to-all (counts, ids, rows, gradients) sends
    # its N - 1 messages at once, paying the latency once
    return Prediction(mem, LinkBytes(ring + sent, ring + received), None, rounds=2 + 4,
                      messages=2 * (n - 1) + 4, server_memory=None)


def expected_unique_ids(cfg: Config, steps: int = 1) -> float:
    """E[u], the distinct rows one worker's batches of `steps` steps read, over all tables (clicks data's
    Zipf law; draws = steps x local batch x bag per table)."""
    d = cfg.workload.dlrm
    draws = steps * cfg.train.global_batch // cfg.backend.world_size * d.bag
    return d.num_tables * expected_unique(d.rows, cfg.workload.clicks.zipf, draws)


def ps_rows_traffic(u: float, dim: int, dense: float, width: int) -> LinkBytes:
    """One PS worker's bytes per exchange with embedding rows: it sends the keys of its u distinct rows
    twice (8 B each, with the row pull and with the row push, which names its rows) and u rows of
    gradients (GEO: deltas), receives u rows, and pushes and pulls the dense part (headers not counted)."""
    return LinkBytes(sent=u * dim * width + 16 * u + dense * width, received=u * dim * width + dense * width)


def _ps_rows(cfg: Config, phi: float) -> Prediction:
    """PS with the embedding tables sharded by row over the servers (psarch/ps/rows.py): a worker holds the
    dense parameters and the u rows of its step (and their gradients); each server a 1/S share of the dense
    part and of every table, with their optimizer state; traffic from ps_rows_traffic with the expected u,
    spread evenly over the servers (keys are hashed to servers). GEO exchanges once every k steps the rows
    its k batches read (u_k of them: each is pulled once, when first read, and its delta pushed at the sync),
    and keeps them, their pulled copies and their local optimizer state."""
    b, t, d = cfg.backend, cfg.train, cfg.workload.dlrm
    width, n, geo = BYTES[t.precision], b.world_size, b.mode == "geo"
    every = b.k_steps if geo else 1
    table = d.num_tables * d.rows * d.dim
    dense, u = phi - table, expected_unique_ids(cfg, every)
    once = ps_rows_traffic(u, d.dim, dense, width)
    link = LinkBytes(once.sent / every, once.received / every)
    k = 0 if geo else optimizer_bytes_per_param(t.optimizer, "fp32", t.momentum)
    # the dense range's round accumulator (a round's rows are held only until the round ends; like the
    # pushes kept early for worker-order sums, at worst (N - 1) x width x the dense range, they are not counted)
    barrier = 4 if b.mode == "sync" or (geo and b.geo_barrier) else 0
    steps = 8 * d.num_tables * d.rows if t.optimizer == "adamw" and not geo else 0   # lazy AdamW's step per row
    server_mem = ((4 + k + barrier) * dense + (4 + k) * table + steps) / b.servers
    rows = u * d.dim * width
    if geo:   # + the dense part's local optimizer and last synced copy, as a dense GEO worker
        kl = optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
        u1 = expected_unique_ids(cfg)
        mem = MemoryPrediction(params=(dense + u * d.dim) * width, grads=(dense + u1 * d.dim) * width,
                               optimizer=kl * (dense + u * d.dim), buffers=4 * (dense + u * d.dim) + 8 * u)
    else:
        mem = MemoryPrediction(params=dense * width + rows, grads=dense * width + rows, optimizer=0.0)
    # a server receives what workers send and sends what they receive; phases: row pull, rows, push, pull
    return Prediction(mem, link, LinkBytes(sent=n * link.received / b.servers, received=n * link.sent / b.servers),
                      rounds=4 / every, messages=4 / every, server_memory=server_mem)


def table_params(cfg: Config) -> int:
    """Parameters in the dlrm model's embedding tables ([workload.dlrm])."""
    d = cfg.workload.dlrm
    return d.num_tables * d.rows * d.dim


def rows_all_gather_bytes(n: int, tables: int, ids: float, row_elements: float, itemsize: int) -> float:
    """Bytes one rank sends (and receives) per step all-gathering its embedding gradients as (ids, rows):
    (N-1) x (8 B per table's id count + 8 B per id + itemsize per row element). ddp pays for the busiest
    rank's ids and rows (collective/rows.py pads to them); torch's gloo all-gathers each rank's own."""
    return (n - 1) * (8 * tables + 8 * ids + itemsize * row_elements)


def _rows(cfg: Config, phi: float, k: int) -> Prediction:
    """ddp / torch_ddp with embeddings = "rows": the dense layers ring all-reduced, the tables' touched rows
    all-gathered; u per table is its expectation under the Zipf law (clicks.expected_unique) for one rank's
    batch (ddp pads to the busiest rank's u, so its measured bytes sit a little above)."""
    b, t, d = cfg.backend, cfg.train, cfg.workload.dlrm
    n, width = b.world_size, BYTES[t.precision]
    dense = phi - table_params(cfg)
    grads = width * phi
    if b.kind == "torch_ddp":  # sparse gradients: after gloo's sum, one (id, row) per id the global batch touched
        touched = d.num_tables * expected_unique(d.rows, cfg.workload.clicks.zipf, t.global_batch * d.bag)
        grads = width * dense + touched * (8 + width * d.dim)
    mem = MemoryPrediction(params=width * phi, grads=grads, optimizer=k * phi)
    if n == 1:
        return Prediction(mem, LinkBytes(), None, rounds=0, messages=0, server_memory=None)
    u = expected_unique_ids(cfg)
    v = 2 * (n - 1) / n * dense * width + rows_all_gather_bytes(n, d.num_tables, u, u * d.dim, width)
    # a ring all-reduce (2 passes), then three all-gathers: id counts, ids, rows
    return Prediction(mem, LinkBytes(v, v), None, rounds=5, messages=5 * (n - 1), server_memory=None)


def config_for(kind: str, n: int, precision: str, optimizer: str, momentum: float = 0.0, stage: int = 1,
               mode: str = "sync", servers: int = 1, k_steps: int = 1, geo_barrier: bool = False,
               staleness_compensation: str = "none") -> Config:
    """A config holding only what `predict` reads: for tables over kinds and world sizes (estimate, benchmarks)."""
    return Config(train=TrainConfig(precision=precision, optimizer=optimizer, momentum=momentum),
                  backend=BackendConfig(kind=kind, world_size=n, stage=max(stage, 1), mode=mode,
                                        servers=servers, k_steps=k_steps, geo_barrier=geo_barrier,
                                        staleness_compensation=staleness_compensation))


def memory_per_rank(kind: str, phi: float, n: int, precision: str = "fp32", optimizer: str = "adamw",
                    momentum: float = 0.0, stage: int = 0, mode: str = "sync") -> MemoryPrediction:
    """`predict(...).memory_per_rank` by kind (benchmarks and tables); zero with stage 0 is DDP."""
    if kind == "zero" and stage == 0:
        kind = "ddp"
    return predict(config_for(kind, n, precision, optimizer, momentum, stage, mode), phi).memory_per_rank


def ps_server_memory(phi: float, servers: int, optimizer: str = "adamw", momentum: float = 0.0) -> float:
    """`predict(...).server_memory` of a sync PS: one server's fp32 range, optimizer state and accumulator."""
    return predict(config_for("ps", 1, "fp32", optimizer, momentum, servers=servers), phi).server_memory or 0.0


def traffic_per_step(kind: str, payload_bytes: float, n: int, stage: int = 0, servers: int = 1) -> dict[str, float]:
    """`predict(...)`'s traffic for an fp32 run whose payload S is `payload_bytes` (benchmarks and tables)."""
    if kind == "zero" and stage == 0:
        kind = "ddp"
    p = predict(config_for(kind, n, "fp32", "adamw", stage=stage, servers=servers), payload_bytes / BYTES["fp32"])
    return p.to_dict()["traffic_per_step"]


# Bytes on an Ethernet link per byte of TCP payload: a 1500-byte MTU frame (1514 B with its Ethernet
# header, as tbf counts it) carries 1448 B of payload after the IP and TCP (with timestamps) headers.
WIRE_OVERHEAD = 1514 / 1448


def cluster_step_time(p: Prediction, compute_s: float, link_mbps: float, server_mbps: float,
                      alpha_s: float = 0.0, buckets: int = 1, overlap: bool = False,
                      hidden_passes: int = 0) -> dict[str, float]:
    """Step time on an emulated cluster: measured compute plus the bytes `p` puts on each link at its rate
    (with WIRE_OVERHEAD), plus α per message in sequence (α-β model). server_mbps: a PS server's link
    (ClusterConfig.server_mbps); collectives ignore it.

    Collectives: every rank sends and receives its volume at once (full duplex). PS: a push phase then a
    pull phase, each as long as the slower of a worker's link and a server's link. Overlap (DDP/ZeRO with
    overlap_comm and several buckets): only what backward (taken as 2/3 of compute) cannot hide waits,
    at least one bucket's share. hidden_passes: ring passes already inside the measured compute (ZeRO-3's
    forward and backward all-gathers block there, where the comm wait does not see them)."""
    worker_rate = link_mbps * 1e6 / 8 / WIRE_OVERHEAD   # payload bytes/s
    if not p.worker.sent and not p.worker.received:
        return {"compute_s": compute_s, "comm_s": 0.0, "step_time_s": compute_s}
    if p.server is not None:
        server_rate = server_mbps * 1e6 / 8 / WIRE_OVERHEAD
        push = max(p.worker.sent / worker_rate, p.server.received / server_rate)
        pull = max(p.worker.received / worker_rate, p.server.sent / server_rate)
        comm = push + pull + p.messages * alpha_s
    else:
        shown = (p.rounds - hidden_passes) / p.rounds
        comm = shown * (p.worker.sent / worker_rate + p.messages * alpha_s)
    exposed = max(comm - 2 / 3 * compute_s, comm / buckets) if overlap and buckets > 1 else comm
    return {"compute_s": compute_s, "comm_s": exposed, "step_time_s": compute_s + exposed}


def cluster_model(cfg: Config, phi: float, zero_groups: int | None = None) -> dict[str, Any]:
    """How a backend's communication meets its compute: buckets (collectives per pass), overlap (whether
    backward hides them) and hidden_passes (ring passes blocking inside forward/backward, ZeRO-3 and FSDP's
    all-gathers). zero_groups: the ZeRO engine's group count (summary extra); the stage-3 groups are units."""
    b = cfg.backend
    # torch DDP (and torch_zero, which wraps it) always sends its buckets from backward's hooks
    overlap = b.overlap_comm if b.kind in ("ddp", "zero") else b.kind in ("torch_ddp", "torch_zero")
    if b.kind == "zero" and zero_groups is not None:
        buckets = zero_groups
    elif b.kind == "zero" and b.stage == 3:
        buckets = 1              # the unit count is a property of the model: unknown here, no overlap credit
    else:
        cap = b.reduce_bucket_size * BYTES[cfg.train.precision] if b.kind == "zero" else b.bucket_cap_mb * 2**20
        # with embeddings "rows" or "sharded" only the dense layers go through the bucketed all-reduce
        reduced = phi if b.embeddings == "dense" else phi - table_params(cfg)
        buckets = -(-int(reduced * BYTES[cfg.train.precision]) // max(1, int(cap)))
    hidden = 2 if (b.kind, b.stage) == ("zero", 3) or b.kind == "torch_fsdp" else 0
    return {"buckets": max(1, buckets), "overlap": overlap, "hidden_passes": hidden}


def cluster_step(cfg: Config, summary: dict[str, Any]) -> dict[str, float]:
    """Measured | predicted step time of a finished run on the emulated cluster: compute (the measured step
    less its communication wait) plus the α-β time of the bytes each link carries (cluster_step_time)."""
    compute = summary["step_time_s"] - (summary.get("comm_s") or 0.0)
    groups = (summary.get("extra") or {}).get("zero_groups")
    m = cluster_model(cfg, summary["params"], groups[0] if groups else None)
    pred = cluster_step_time(predict(cfg, summary["params"]), compute, cfg.cluster.link_mbps,
                             cfg.cluster.server_mbps, summary["cluster"]["alpha_s"], **m)
    return {"measured_s": summary["step_time_s"], "predicted_s": pred["step_time_s"],
            "compute_s": compute, "predicted_comm_s": pred["comm_s"]}
