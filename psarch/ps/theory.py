"""What theory predicts for the parameter server: each worker pushes S (gradients; GEO: deltas) and pulls S
each exchange, split evenly over the servers (compressed as train.compression says: pushes always, pulls in GEO,
pushed_bytes and pulled_bytes); with embedding tables sharded by row over the servers, only
the rows a batch touches move. k dedicated servers load a worker's link with S and a server's with N·S/k each
way; k servers colocated with workers 0..k-1 keep a worker's share for its own server (S/k) and a server's for
its own worker off the link, so a node with both carries (k-1)/k·S + (N-1)/k·S = (N+k-2)/k·S each way (k = N:
2(N-1)/N·S, as all-reduce). An emulated run's step is predicted by the step simulator from the
PS's program (psarch/ps/program.py: partitions pipelined, pushes from backward's hooks, servers shared). BytePS's
optimum (`byteps_optimum`) is the reference line. With backend.replicas = r every partition's exchange
goes to its r + 1 holders: a worker's and a server's bytes, and a server's memory, are (1 + r) x those above
(`replication`). The shared algebra is psarch.theory's."""
from __future__ import annotations

from typing import TYPE_CHECKING

from psarch.ps.partitions import replicas, server_partitions
from psarch.ps.messages import pulls_deltas
from psarch.theory import (BYTES, LinkBytes, MemoryPrediction, NodePrediction, Prediction, expected_unique_ids,
                           optimizer_bytes_per_param, table_params, topk_k)

if TYPE_CHECKING:
    from psarch.config import Config
    from psarch.ps.program import RowBytes

SERVER = "server"   # the role a PS server plays in a prediction's nodes and in summary.json's measured nodes


def dense(cfg: Config, phi: float) -> Prediction:
    """Each worker pushes S and pulls S, split evenly over the servers; GEO does so once every k_steps steps
    and keeps a local optimizer and the last synced fp32 model. A server holds its fp32 range and, except in
    GEO (deltas are added), the optimizer state for it; barrier modes sum a round's pushes in an fp32
    accumulator; delay compensation keeps the version last sent to each worker; GEO's compressed pulls keep
    what each worker holds (server/deltas.py; under the barrier one copy and the round's delta). Not counted:
    the pushes a barrier server keeps while it waits for a predecessor's (it sums in worker order): none at a
    round's end, at worst (N - 1) x width x its range mid-round (worker 0 last); how many depends on arrival order,
    so servers report their peak."""
    b, t = cfg.backend, cfg.train
    n, width = b.world_size, BYTES[t.precision]
    every = b.push_every
    parts = [hi - lo for server in dense_partitions(cfg, phi) for lo, hi in server]
    up, down = sum(pushed_bytes(cfg, size) for size in parts), sum(pulled_bytes(cfg, size) for size in parts)
    k = optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
    server_k = 0 if b.mode == "geo" else optimizer_bytes_per_param(t.optimizer, "fp32", t.momentum)
    kept = 4 if b.barrier else 0
    kept += 4 * n if b.mode in ("async", "ssp") and b.staleness_compensation == "dc" else 0
    # GEO's compressed pulls: what each worker holds, in fp32 (with the barrier all hold the same: one copy)
    kept += (4 if b.barrier else 4 * n) if pulls_deltas(cfg) else 0
    kept_bytes = kept * phi / b.servers
    if pulls_deltas(cfg) and b.barrier:   # and the round's delta, computed once and kept for every worker's pull
        kept_bytes += down / b.servers
    error = width * phi if t.compression == "topk" else 0.0   # top-k keeps the error of every element it pushes
    if b.mode == "geo":
        mem = MemoryPrediction(params=width * phi, grads=width * phi, optimizer=k * phi, buffers=4 * phi + error)
    else:
        mem = MemoryPrediction(params=width * phi, grads=width * phi, optimizer=0.0, buffers=error)
    copies = 1 + replicas(cfg)   # chain replication: a worker's exchange goes to each partition's every holder
    held = MemoryPrediction(params=copies * 4 * phi / b.servers, grads=0.0,
                            optimizer=copies * server_k * phi / b.servers, buffers=copies * kept_bytes)
    worker = NodePrediction(mem, LinkBytes(copies * up / every, copies * down / every), ranks=range(n))
    server = NodePrediction(held, LinkBytes(copies * n * down / b.servers / every, copies * n * up / b.servers / every),
                            host=colocated(cfg), instances=b.servers)
    return Prediction({"worker": worker, SERVER: server}, rounds=2 / every, messages=2 / every)


def colocated(cfg: Config) -> str | None:
    """The role whose device a server shares: a worker's where backend.server_placement = "colocated"."""
    return "worker" if cfg.backend.server_placement == "colocated" else None


def replication(cfg: Config, inbound: float, outbound: float) -> LinkBytes:
    """Chain replication's bytes on the servers' links (backend.replicas = r, psarch/ps/replication.py): each
    replica receives what its primary receives and sends what it sends, so r x the servers' inbound and outbound
    bytes (of the exchanges a replica takes part in: pushes and pulls, not fetch, save or done). With the
    primaries' counted bytes, this is what the replicas' counters must show, to the byte."""
    r = replicas(cfg)
    return LinkBytes(sent=r * outbound, received=r * inbound)


def pushed_bytes(cfg: Config, numel: int) -> float:
    """Bytes a push of a partition of `numel` elements carries: cast to 2 bytes (train.compression fp16/bf16), its
    k (int64 index, value) pairs (top-k), else numel in the wire dtype."""
    t = cfg.train
    if t.compression == "topk":
        return topk_k(numel, t.topk_ratio) * (8 + BYTES[t.precision])
    return numel * (2 if t.compression in ("fp16", "bf16") else BYTES[t.precision])


# A top-k push's passes over its partition in device memory (psarch/ps/worker/topk.py): the error added (2 read,
# 1 written), |acc| (1 read, 1 written) and the selection (1 read: at least one pass)
TOPK_PUSH_PASSES = 6


def compressing_bytes(cfg: Config, numel: int) -> float:
    """Bytes compressing a push of `numel` elements moves in device memory: top-k's TOPK_PUSH_PASSES over the
    partition (memory-bound); a cast's, nothing counted."""
    t = cfg.train
    return TOPK_PUSH_PASSES * numel * BYTES[t.precision] if t.compression == "topk" else 0.0


def pulled_bytes(cfg: Config, numel: int) -> float:
    """Bytes a pull of a partition of `numel` elements carries: in GEO with compression its change since what the
    worker holds, compressed as a push is (pushed_bytes: k (index, value) pairs for top-k, 2 bytes an element for
    fp16/bf16; psarch/ps/server/deltas.py), else the parameters whole in the wire dtype."""
    return pushed_bytes(cfg, numel) if pulls_deltas(cfg) else numel * BYTES[cfg.train.precision]


def dense_partitions(cfg: Config, phi: float) -> list[list[tuple[int, int]]]:
    """Each server's partitions of the dense parameters (embedding rows have their own keyed path)."""
    dense = int(phi - (table_params(cfg) if cfg.backend.embeddings == "rows" else 0))
    return server_partitions(cfg, dense)


def byteps_optimum(n: int, k: int, s: float, rate: float) -> float:
    """BytePS's communication-optimal time (Jiang et al., OSDI '20, eq. 4) for N workers with k more CPU servers
    (colocated summation on the workers' own machines included) and S bytes each way at `rate` bytes/s:
    2N(N-1)S / ((N^2 + kN - 2k)·rate); k = 0 is all-reduce's 2(N-1)/N·S/rate, k = N is S/rate."""
    return 2 * n * (n - 1) * s / ((n * n + k * n - 2 * k) * rate)


def rows_traffic(u: float, dim: int, dense_params: float, width: int) -> LinkBytes:
    """One PS worker's bytes per exchange with embedding rows: it sends the keys of its u distinct rows
    twice (8 B each, with the row pull and with the row push, which names its rows) and u rows of
    gradients (GEO: deltas), receives u rows, and pushes and pulls the dense part (headers not counted): row_bytes'
    with every server together."""
    rows = row_bytes(u, dim, width, 1)
    return LinkBytes(sent=rows.keys + rows.grads + dense_params * width, received=rows.rows + dense_params * width)


def row_bytes(u: float, dim: int, width: int, servers: int) -> RowBytes:
    """What a worker exchanges with each of `servers` servers per exchange for its u embedding rows of `dim`
    elements, spread evenly over the servers (keys are hashed to them): the keys (8 B each) with the row pull, u
    rows back, their gradients with their keys again in the row push."""
    from psarch.ps.program import RowBytes

    return RowBytes(keys=8 * u / servers, rows=u * dim * width / servers, grads=(u * dim * width + 8 * u) / servers)


def rows(cfg: Config, phi: float) -> Prediction:
    """The embedding tables sharded by row over the servers (psarch/ps/rows.py): a worker holds the dense
    parameters and the u rows of its step (and their gradients); each server a 1/S share of the dense part
    and of every table, with their optimizer state; traffic from rows_traffic with the expected u, spread
    evenly over the servers (keys are hashed to servers), the dense partitions pushed as train.compression says
    (pushed_bytes; GEO: deltas, pulled as compressed deltas too, pulled_bytes) beside the rows, which move whole;
    top-k keeps the error of every dense element it pushes. GEO exchanges once every k steps the rows its k
    batches read (u_k of them: each is pulled once, when first read, and its delta pushed at the sync), and keeps
    them, their pulled copies and their local optimizer state; with compression its servers keep what each worker
    holds of the dense part (and the barrier's round delta), as dense counts them."""
    b, t, d = cfg.backend, cfg.train, cfg.workload.dlrm
    width, n, geo = BYTES[t.precision], b.world_size, b.mode == "geo"
    every = b.push_every
    table = table_params(cfg)
    dense_params, u = phi - table, expected_unique_ids(cfg, every)
    once = rows_traffic(u, d.dim, 0, width)   # the rows whole; the dense partitions as train.compression pushes them
    parts = [hi - lo for server in dense_partitions(cfg, phi) for lo, hi in server]
    up, down = sum(pushed_bytes(cfg, size) for size in parts), sum(pulled_bytes(cfg, size) for size in parts)
    link = LinkBytes((once.sent + up) / every, (once.received + down) / every)
    k = 0 if geo else optimizer_bytes_per_param(t.optimizer, "fp32", t.momentum)
    # the dense range's round accumulator (a round's rows are held only until the round ends; like the
    # pushes kept early for worker-order sums, at worst (N - 1) x width x the dense range, they are not counted)
    barrier = 4 if b.barrier else 0
    steps = 8 * d.num_tables * d.rows if t.optimizer == "adamw" and not geo else 0   # lazy AdamW's step per row
    # GEO's compressed pulls: what each worker holds of the dense part, and the barrier's round delta, as dense's
    kept = ((4 if b.barrier else 4 * n) * dense_params + (down if b.barrier else 0)) if pulls_deltas(cfg) else 0.0
    held = MemoryPrediction(params=4 * (dense_params + table) / b.servers, grads=0.0,
                            optimizer=(k * (dense_params + table) + steps) / b.servers,
                            buffers=(barrier * dense_params + kept) / b.servers)
    row_bytes = u * d.dim * width
    error = width * dense_params if t.compression == "topk" else 0.0   # top-k's error feedback (rows move whole)
    if geo:   # + the dense part's local optimizer and last synced copy, as a dense GEO worker
        kl = optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
        u1 = expected_unique_ids(cfg)
        mem = MemoryPrediction(params=(dense_params + u * d.dim) * width, grads=(dense_params + u1 * d.dim) * width,
                               optimizer=kl * (dense_params + u * d.dim),
                               buffers=4 * (dense_params + u * d.dim) + 8 * u + error)
    else:
        mem = MemoryPrediction(params=dense_params * width + row_bytes, grads=dense_params * width + row_bytes,
                               optimizer=0.0, buffers=error)
    # a server receives what workers send and sends what they receive; phases: row pull, rows, push, pull
    server = NodePrediction(held, LinkBytes(sent=n * link.received / b.servers, received=n * link.sent / b.servers),
                            host=colocated(cfg), instances=b.servers)
    return Prediction({"worker": NodePrediction(mem, link, ranks=range(n)), SERVER: server},
                      rounds=4 / every, messages=4 / every)
