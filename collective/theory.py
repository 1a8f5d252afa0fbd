"""What theory predicts for collective data parallelism (ddp, torch_ddp): the model replicated, gradients
all-reduced by ring, 2(N−1)/N · S per rank per step; with embedding tables moved as rows (all-gather of the
touched rows) or row-sharded over the ranks (all-to-all). The shared algebra is psarch.theory's."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

from psarch.throughput import warmup_steps
from psarch.zipf import expected_unique
from psarch.theory import (BYTES, LinkBytes, MemoryPrediction, NodePrediction, Prediction, expected_unique_ids,
                           optimizer_bytes_per_param, ring_passes, sharded_memory, table_params, topk_k)

if TYPE_CHECKING:
    from collective.program import TableServers
    from psarch.config import Config
    from psarch.theory.program import DataStep, Program


def replicated(cfg: Config, phi: float) -> Prediction:
    """Dense data parallelism: the whole model on every rank, one ring all-reduce (2 passes) per step."""
    return ring_passes(sharded_memory(cfg, phi, 0), cfg, phi, 2)


def rows_all_gather_bytes(n: int, tables: int, ids: float, row_elements: float, itemsize: int) -> float:
    """Bytes one rank sends (and receives) per step all-gathering its embedding gradients as (ids, rows):
    (N-1) x (8 B per table's id count + 8 B per id + itemsize per row element). ddp pays for the busiest
    rank's ids and rows (collective/rows.py pads to them); torch's gloo all-gathers each rank's own."""
    return (n - 1) * (8 * tables + 8 * ids + itemsize * row_elements)


def rows(cfg: Config, phi: float, sparse_grads: bool = False) -> Prediction:
    """embeddings = "rows": the dense layers ring all-reduced, the tables' touched rows all-gathered; u per
    table is its expectation under the Zipf law (clicks.expected_unique) for one rank's batch (ddp pads to
    the busiest rank's u, so its measured bytes sit a little above). sparse_grads (torch_ddp): the tables'
    gradients are torch sparse tensors, after gloo's sum one (id, row) per id the global batch touched."""
    t, d = cfg.train, cfg.workload.dlrm
    n, width = cfg.backend.world_size, BYTES[t.precision]
    k = optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
    dense = phi - table_params(cfg)
    grads = width * phi
    if sparse_grads:
        touched = d.num_tables * expected_unique(d.rows, cfg.workload.clicks.zipf, t.global_batch * d.bag)
        grads = width * dense + touched * (8 + width * d.dim)
    mem = MemoryPrediction(params=width * phi, grads=grads, optimizer=k * phi)
    if n == 1:
        return Prediction.alike(mem, LinkBytes(), n, rounds=0, messages=0)
    u = expected_unique_ids(cfg)
    v = 2 * (n - 1) / n * dense * width + rows_all_gather_bytes(n, d.num_tables, u, u * d.dim, width)
    # a ring all-reduce (2 passes), then three all-gathers: id counts, ids, rows
    return Prediction.alike(mem, LinkBytes(v, v), n, rounds=5, messages=5 * (n - 1))


def ps_tables(cfg: Config, phi: float) -> Prediction:
    """embeddings = "ps" on ddp (the hybrid, collective/ps_tables.py): the dense layers ring all-reduced, the
    tables on PS servers (with_ps_tables)."""
    return with_ps_tables(replicated(cfg, phi - table_params(cfg)), cfg, phi)


def with_ps_tables(dense: Prediction, cfg: Config, phi: float) -> Prediction:
    """`dense` (what a collective backend predicts for the dense layers alone) with the tables on backend.servers
    PS servers: a rank also pulls its u expected rows and pushes their gradients (the PS's rows_traffic with no
    dense part, headers not counted) and holds the u rows and their gradients; a server its 1/S of the tables
    and their row-wise optimizer state; three more phases: the row pull, its rows, the row push."""
    from psarch.ps.theory import colocated, rows_traffic

    t, d, b = cfg.train, cfg.workload.dlrm, cfg.backend
    n, u = b.world_size, expected_unique_ids(cfg)
    rows = u * d.dim * 4   # rows move and are updated in fp32 (the spec refuses other precisions)
    m = dense.memory_per_rank
    mem = dataclasses.replace(m, params=m.params + rows, grads=m.grads + rows)
    link = rows_traffic(u, d.dim, 0, 4)
    steps = 8 * d.num_tables * d.rows if t.optimizer == "adamw" else 0   # lazy AdamW's step per row
    k = optimizer_bytes_per_param(t.optimizer, "fp32", t.momentum)
    table = MemoryPrediction(params=4 * table_params(cfg) / b.servers, grads=0.0,
                             optimizer=(k * table_params(cfg) + steps) / b.servers)
    worker = NodePrediction(mem, LinkBytes(dense.link.sent + link.sent, dense.link.received + link.received),
                            ranks=range(n))
    server = NodePrediction(table, LinkBytes(sent=n * link.received / b.servers, received=n * link.sent / b.servers),
                            host=colocated(cfg))
    return Prediction({"worker": worker, "server": server}, rounds=dense.rounds + 3, messages=dense.messages + 3)


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


def sharded(cfg: Config, phi: float) -> Prediction:
    """embeddings = "sharded": each rank holds ceil(rows/N) rows of every table (padding included) beside the
    whole dense part, all-reduces the dense gradients by ring, and moves rows by all-to-all. A rank's ids per
    table are u = E[distinct ids] of its global_batch/N x bag Zipf draws, of which (N-1)/N live elsewhere."""
    t, d = cfg.train, cfg.workload.dlrm
    n, width = cfg.backend.world_size, BYTES[t.precision]
    k = optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
    dense = phi - table_params(cfg)
    held = dense + d.num_tables * -(-d.rows // n) * d.dim
    mem = MemoryPrediction(params=width * held, grads=width * held, optimizer=k * held)
    if n == 1:
        return Prediction.alike(mem, LinkBytes(), n, rounds=0, messages=0)
    u = expected_unique_ids(cfg)
    sent, received = sharded_bytes(u * (n - 1) / n, u * (n - 1) / n, d.num_tables, d.dim, width, n)
    ring = 2 * (n - 1) / n * dense * width
    # two ring passes of N - 1 messages in sequence; each all-to-all (counts, ids, rows, gradients) sends
    # its N - 1 messages at once, paying the latency once
    return Prediction.alike(mem, LinkBytes(ring + sent, ring + received), n, rounds=2 + 4,
                            messages=2 * (n - 1) + 4)


# ---------------------------------------------------------------- gradient compression (train.compression)

INDEX_BYTES = 4   # top-k's indices travel as int32: a bucket holds fewer than 2^31 elements
MIN_COMPRESSION_RATE = 2   # torch's powerSGD_hook default: a matrix is factored only where that saves 2x


def powersgd_plan(shapes: Sequence[Sequence[int]], rank: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(elements all-reduced uncompressed, (n, m, r) of each matrix factored), as torch's powerSGD_hook decides:
    a tensor is viewed as n x m with n its first dimension, r = min(n, m, rank), and factored into P (n x r) and
    Q (m x r) where MIN_COMPRESSION_RATE x (n + m) r < n m; the rest (biases, norms) go whole."""
    whole, factored = 0, []
    for shape in shapes:
        numel = math.prod(shape)
        n = shape[0] if len(shape) else 1
        m = numel // n if n else 0
        r = min(n, m, rank)
        if MIN_COMPRESSION_RATE * (n + m) * r < n * m:
            factored.append((n, m, r))
        else:
            whole += numel
    return whole, factored


def ring_all_reduce_bytes(numel: int, itemsize: int, n: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of `numel` elements: 2(N-1) chunks of ceil(L/N)
    (collective.comm.ring_bytes, which the meters count, says the same)."""
    return 0 if n == 1 or numel == 0 else 2 * (n - 1) * -(-numel // n) * itemsize


# one collective of a bucket: (ALL_REDUCE, elements, bytes per element) or (ALL_GATHER, bytes each rank gives, 1)
ALL_REDUCE, ALL_GATHER = "all_reduce", "all_gather"
Collective = tuple[str, int, int]


def bucket_collectives(compression: str, shapes: Sequence[Sequence[int]], itemsize: int, ratio: float = 0.01,
                       rank: int = 1, compressing: bool = True) -> tuple[list[Collective], list[Collective]]:
    """The collectives that average one bucket of gradients of these shapes (collective/compression.py): those
    launched as the bucket fills, and those issued after backward. fp16/bf16 an all-reduce of 2-byte elements;
    top-k an all-gather of its k (int32 index, value) pairs; PowerSGD (once `compressing`, after its warm-up) the
    whole tensors and every P (n x r) all-reduced at once, every Q (m x r) after backward (its finish); else the
    bucket whole."""
    numel = sum(math.prod(s) for s in shapes)
    if compression in ("fp16", "bf16"):
        return [(ALL_REDUCE, numel, 2)], []
    if compression == "topk":
        return [(ALL_GATHER, topk_k(numel, ratio) * (INDEX_BYTES + itemsize), 1)], []
    if compression == "powersgd" and compressing:
        whole, factored = powersgd_plan(shapes, rank)
        launched = [(ALL_REDUCE, e, itemsize) for e in (whole, sum(a * r for a, _, r in factored)) if e]
        q = sum(m * r for _, m, r in factored)
        return launched, [(ALL_REDUCE, q, itemsize)] if q else []
    return [(ALL_REDUCE, numel, itemsize)], []


# Top-k's passes over its bucket in device memory (collective/compression.py's TopK): as the bucket is ready, the
# error added (2 read, 1 written), |g| (1 read, 1 written), the selection (1 read: at least one pass) and the new
# error (1 read, 1 written); after the all-gather, the bucket zeroed before the pairs are added (1 written)
TOPK_PASSES = (8, 1)


def compression_work(compression: str, shapes: Sequence[Sequence[int]], itemsize: int, ratio: float = 0.01,
                     rank: int = 1, compressing: bool = True) -> tuple[tuple[float, float], tuple[float, float]]:
    """A bucket's compression work, (FLOPs, bytes moved in device memory), as it is ready and after backward
    (collective/compression.py). PowerSGD (once `compressing`), per n x m matrix factored at rank r: Q
    orthonormalised (Gram-Schmidt, 2 m r² FLOPs; QR where r > 2 costs about as much) and P = M Q (2 n m r) as it is
    ready; then P orthonormalised (2 n r²), Q = Mᵀ P (2 n m r) and the approximation P Qᵀ (2 n m r). Top-k: memory-
    bound, TOPK_PASSES over the bucket's bytes. fp16/bf16 casts and the bucket whole: nothing counted."""
    numel = sum(math.prod(s) for s in shapes)
    if compression == "topk":
        return (0.0, TOPK_PASSES[0] * numel * itemsize), (0.0, TOPK_PASSES[1] * numel * itemsize)
    if compression == "powersgd" and compressing:
        _, factored = powersgd_plan(shapes, rank)
        ready = sum(2.0 * m * r * r + 2.0 * n * m * r for n, m, r in factored)
        after = sum(2.0 * n * r * r + 4.0 * n * m * r for n, m, r in factored)
        return (ready, 0.0), (after, 0.0)
    return (0.0, 0.0), (0.0, 0.0)


def collective_bytes(c: Collective, n: int) -> int:
    """Bytes one rank sends (= receives) in collective `c` among n ranks by ring."""
    kind, size, itemsize = c
    return ring_all_reduce_bytes(size, itemsize, n) if kind == ALL_REDUCE else (n - 1) * size


def compressed_bucket_bytes(compression: str, shapes: Sequence[Sequence[int]], itemsize: int, n: int,
                            ratio: float = 0.01, rank: int = 1, compressing: bool = True) -> int:
    """Bytes one rank sends (= receives) averaging one bucket of gradients of these shapes (bucket_collectives):
    fp16/bf16 a ring all-reduce of 2-byte elements; top-k an all-gather of its k (index, value) pairs,
    (N-1) k (4 + itemsize); PowerSGD three ring all-reduces: the whole tensors, every P, every Q."""
    launched, later = bucket_collectives(compression, shapes, itemsize, ratio, rank, compressing)
    return sum(collective_bytes(c, n) for c in launched + later)


def error_feedback_bytes(compression: str, shapes: Sequence[Sequence[int]], itemsize: int, rank: int = 1) -> int:
    """Bytes a rank keeps from step to step for a bucket: top-k and PowerSGD the error of the bucket (its size);
    PowerSGD also P and Q, kept for the warm start, (n + m) r per factored matrix."""
    numel = sum(math.prod(s) for s in shapes)
    if compression == "topk":
        return numel * itemsize
    if compression == "powersgd":
        return (numel + sum((a + m) * r for a, m, r in powersgd_plan(shapes, rank)[1])) * itemsize
    return 0


def ddp_bucket_shapes(cfg: Config) -> list[list[tuple[int, ...]]]:
    """The shapes of each of ddp's buckets, as collective/ddp.py lays them out (parameters in reverse order, cut at
    bucket_cap_mb), from the model built on the meta device."""
    import torch

    from collective.bucket import assign_buckets
    from psarch.precision import compute_dtype
    from psarch.workload import theory_model

    dtype = compute_dtype(cfg.train.precision)   # the shared model is not cast: its shapes are, as the trainer's
    params = [torch.empty(p.shape, dtype=dtype, device="meta") for p in theory_model(cfg).parameters()
              if p.requires_grad][::-1]
    offsets = [0]
    for p in params[:-1]:
        offsets.append(offsets[-1] + p.numel())
    return [[tuple(params[i].shape) for i in b.params]
            for b in assign_buckets(params, offsets, cfg.backend.bucket_cap_mb * 2**20)]


_BUCKETS: dict[str, tuple[int, list[float]]] = {}   # a model's (trainable parameters, ddp's bucket elements)


def trainer_buckets(cfg: Config, phi: float) -> list[float] | None:
    """The gradient bytes of each of ddp's buckets as its trainer assigns them (ddp_bucket_shapes:
    collective/bucket.py's assign_buckets, which closes a bucket at a parameter's edge), in the order backward readies
    them; None where the config's model does not hold `phi` trainable parameters (a Φ asked about alone, as the
    estimator's)."""
    t = cfg.train
    # what decides the parameters that train and their shapes (lora_alpha only scales), and the buckets' cut
    key = repr((cfg.workload, t.trainable, t.lora_rank, t.lora_targets, t.precision, cfg.backend.bucket_cap_mb))
    if key not in _BUCKETS:
        sizes = [sum(math.prod(s) for s in bucket) for bucket in ddp_bucket_shapes(cfg)]
        _BUCKETS[key] = (sum(sizes), [float(x) for x in sizes])
    total, elements = _BUCKETS[key]
    return [x * BYTES[t.precision] for x in elements] if total == int(phi) else None


def compressed(cfg: Config, phi: float) -> Prediction:
    """ddp with train.compression: the model replicated, each bucket averaged compressed; bytes per step the mean
    over the run (PowerSGD's warm-up steps all-reduce whole), memory with the error-feedback buffers."""
    t, n = cfg.train, cfg.backend.world_size
    width = BYTES[t.precision]
    buckets = ddp_bucket_shapes(cfg)

    def step_bytes(compressing: bool) -> float:
        return sum(compressed_bucket_bytes(t.compression, s, width, n, t.topk_ratio, t.powersgd_rank, compressing)
                   for s in buckets)

    warm = min(t.powersgd_warmup_steps, t.steps) if t.compression == "powersgd" else 0
    v = (warm * step_bytes(False) + (t.steps - warm) * step_bytes(True)) / t.steps
    mem = sharded_memory(cfg, phi, 0)
    if t.steps > warm:   # PowerSGD allocates its buffers at its first compressed step
        mem.buffers = sum(error_feedback_bytes(t.compression, s, width, t.powersgd_rank) for s in buckets)
    passes = {"fp16": 2, "bf16": 2, "topk": 1, "powersgd": 6}.get(t.compression, 2)
    if n == 1:
        return Prediction.alike(mem, LinkBytes(), n, rounds=0, messages=0)
    return Prediction.alike(mem, LinkBytes(v, v), n, rounds=passes, messages=passes * (n - 1))


def compressed_program(cfg: Config, step: DataStep, overlap: bool, reduced: bool, chained: bool = False) -> Program:
    """ddp's step with train.compression as a program (collective/program.py's collectives): ddp's buckets as its
    trainer lays them out (ddp_bucket_shapes), each ready at its share of backward's bytes and averaged by its
    bucket_collectives. The step is the median step's (of the steps after the run's warm-up, psarch.throughput.
    warmup_steps): compressed where most of those are (PowerSGD's warm-up steps all-reduce whole). chained: every
    collective of a bucket issued as it fills (torch's powerSGD_hook all-reduces Q as soon as P is in, within backward;
    psarch's PowerSGD after backward). The compression's own work (compression_work), priced by the step's device
    rates: each bucket's first part in its hook as it is ready, delaying backward; its second part after backward
    (chained: in the hook too, torch's hook computing Q as P is in)."""
    from collective.program import collectives

    t, n = cfg.train, cfg.backend.world_size
    width = BYTES[t.precision]
    warm = min(t.powersgd_warmup_steps, t.steps) if t.compression == "powersgd" else 0
    timed = warmup_steps(cfg)   # the median step is of the steps after these
    compressing = 2 * (t.steps - max(warm, timed)) >= t.steps - timed
    shapes = ddp_bucket_shapes(cfg)
    sizes = [float(width * sum(math.prod(s) for s in bucket)) for bucket in shapes]
    launched, later, hooks, finish = [], [], [], 0.0
    for b, bucket in enumerate(shapes):
        now, after = bucket_collectives(t.compression, bucket, width, t.topk_ratio, t.powersgd_rank, compressing)
        launched.append([_ring_call(f"c{b}.{i}", c, n) for i, c in enumerate(now + after if chained else now)])
        later += [] if chained else [_ring_call(f"c{b}.{len(now) + i}", c, n) for i, c in enumerate(after)]
        ready, rest = (step.seconds(*w) for w in compression_work(t.compression, bucket, width, t.topk_ratio,
                                                                    t.powersgd_rank, compressing))
        hooks.append(ready + rest if chained else ready)
        finish += 0.0 if chained else rest
    return collectives(n, sizes, launched, later, step, overlap, reduced, hooks_s=hooks, finish_s=finish)[0]


def _ring_call(name: str, c: Collective, n: int) -> tuple[str, float, int]:
    """Collective `c` as ring passes (collective/program.py's ring): an all-reduce 2 passes over its bytes, an
    all-gather 1 pass over the n ranks' contributions."""
    kind, size, itemsize = c
    return (name, size * itemsize, 2) if kind == ALL_REDUCE else (name, n * size, 1)


def rows_program(cfg: Config, phi: float, step: DataStep, overlap: bool, reduced: bool) -> Program:
    """embeddings = "rows" as a program: the dense layers' buckets ring all-reduced (collective/program.py), then,
    queued behind them after backward, the three all-gathers of collective/rows.py: each rank's id counts, its u
    ids and their rows (u the expectation `rows` counts, rows_all_gather_bytes)."""
    from collective.program import collectives
    from psarch.theory.program import chunks

    t, d, n = cfg.train, cfg.workload.dlrm, cfg.backend.world_size
    width, u = BYTES[t.precision], expected_unique_ids(cfg)
    dense = chunks((phi - table_params(cfg)) * width, cfg.backend.bucket_cap_mb * 2**20)
    later = [("ag_counts", n * 8.0 * d.num_tables, 1), ("ag_ids", n * 8 * u, 1), ("ag_rows", n * u * d.dim * width, 1)]
    return collectives(n, dense, [[(f"ar{b}", size, 2)] for b, size in enumerate(dense)], later, step, overlap,
                       reduced)[0]


def sharded_program(cfg: Config, phi: float, step: DataStep, overlap: bool, reduced: bool) -> Program:
    """embeddings = "sharded" as a program: before forward the all-to-alls of collective/sharded.py's fetch (id
    counts, the ids asked of their owners, the rows answered), the dense layers' buckets ring all-reduced from
    backward, then the rows' gradients all-to-all to their owners (sharded_bytes: (N-1)/N of a rank's u ids live
    elsewhere)."""
    from collective.program import ALL_TO_ALL, collectives
    from psarch.theory.program import chunks

    t, d, n = cfg.train, cfg.workload.dlrm, cfg.backend.world_size
    width, away = BYTES[t.precision], expected_unique_ids(cfg) * (n - 1) / n
    row = d.dim * width
    dense = chunks((phi - table_params(cfg)) * width, cfg.backend.bucket_cap_mb * 2**20)
    before = [("a2a_counts", 8.0 * d.num_tables * (n - 1), ALL_TO_ALL), ("a2a_ids", 8 * away, ALL_TO_ALL),
              ("a2a_rows", row * away, ALL_TO_ALL)]
    return collectives(n, dense, [[(f"ar{b}", size, 2)] for b, size in enumerate(dense)],
                       [("a2a_grads", row * away, ALL_TO_ALL)], step, overlap, reduced, before)[0]


def table_servers(cfg: Config) -> TableServers:
    """The hybrid's tables on backend.servers PS servers (with_ps_tables): each rank's u expected rows, in fp32."""
    from collective.program import TableServers
    from psarch.ps.theory import row_bytes

    b = cfg.backend
    return TableServers(b.servers, b.server_placement == "colocated",
                        row_bytes(expected_unique_ids(cfg), cfg.workload.dlrm.dim, 4, b.servers))


def ps_tables_program(cfg: Config, phi: float, step: DataStep, overlap: bool, reduced: bool) -> Program:
    """embeddings = "ps" on ddp (the hybrid) as a program: the dense layers' buckets ring all-reduced, each rank's
    rows pulled from every server before forward and their gradients pushed after backward."""
    from collective.program import collectives
    from psarch.theory.program import chunks

    dense = chunks((phi - table_params(cfg)) * BYTES[cfg.train.precision], cfg.backend.bucket_cap_mb * 2**20)
    return collectives(cfg.backend.world_size, dense, [[(f"ar{b}", size, 2)] for b, size in enumerate(dense)], [],
                       step, overlap, reduced, tables=table_servers(cfg))[0]
