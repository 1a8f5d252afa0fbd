"""What theory predicts for gradient compression under collective data parallelism (train.compression with ddp and
torch_ddp): each bucket's collectives (fp16/bf16 all-reduce, top-k's all-gather of (index, value) pairs,
PowerSGD's two all-reduces of P and Q), their bytes, the compression's own work, error feedback's memory, and the
compressed step as a program. The uncompressed ring and the embeddings' treatments are collective/theory.py's."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

from collective.theory import ddp_bucket_shapes
from psarch.throughput import warmup_steps
from psarch.theory import BYTES, LinkBytes, Prediction, sharded_memory, table_params, topk_k

if TYPE_CHECKING:
    from psarch.config import Config
    from psarch.theory.program import DataStep, Program


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
        ready, before_q, after_q = powersgd_work(powersgd_plan(shapes, rank)[1])
        return (ready, 0.0), (before_q + after_q, 0.0)
    return (0.0, 0.0), (0.0, 0.0)


def powersgd_work(factored: Sequence[tuple[int, int, int]]) -> tuple[float, float, float]:
    """PowerSGD's FLOPs over the (n, m, r) matrices it factors: as the bucket is ready (Q orthonormalised, 2 m r²;
    P = M Q, 2 n m r), then before Q's all-reduce (P orthonormalised, 2 n r²; Q = Mᵀ P, 2 n m r) and after it
    (the approximation P Qᵀ, 2 n m r)."""
    return (sum(2.0 * m * r * r + 2.0 * n * m * r for n, m, r in factored),
            sum(2.0 * n * r * r + 2.0 * n * m * r for n, m, r in factored),
            sum(2.0 * n * m * r for n, m, r in factored))


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


def compressed(cfg: Config, phi: float) -> Prediction:
    """ddp with train.compression: the model replicated, each bucket averaged compressed; bytes per step the mean
    over the run (PowerSGD's warm-up steps all-reduce whole), memory with the error-feedback buffers. With embeddings
    other than "dense" the buckets hold the dense layers alone (ddp_bucket_shapes) and the tables' rows move whole
    beside them, as the treatment moves them uncompressed (collective/theory.py's beside_dense)."""
    from collective.theory import beside_dense, rows, sharded

    e = cfg.backend.embeddings
    if e == "dense":
        return _compressed_buckets(cfg, phi)
    dense = _compressed_buckets(cfg, phi - table_params(cfg))
    if e != "ps":   # the model as the treatment holds it (rows: whole; sharded: its rows' shard), and the buffers
        held = (rows if e == "rows" else sharded)(cfg, phi).memory_per_rank
        buffers = dense.memory_per_rank.buffers
        dense = Prediction.alike(dataclasses.replace(held, buffers=held.buffers + buffers), dense.link,
                                 cfg.backend.world_size, rounds=dense.rounds, messages=dense.messages)
    return beside_dense(dense, cfg, phi)


def _compressed_buckets(cfg: Config, phi: float) -> Prediction:
    """The replicated model of `phi` parameters, ddp's buckets (ddp_bucket_shapes) averaged compressed."""
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
    (chained: in the hook too, torch's hook computing Q as P is in). Embedding rows (collective/theory.py's
    embedding_calls) move whole: fetched before forward, exchanged after backward as the trainer does, behind the
    last bucket's launched collectives and before the finish (PowerSGD's Q, top-k's sums), or on PS servers."""
    from collective.program import collectives
    from collective.theory import embedding_calls

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
    before, rows, tables = embedding_calls(cfg)
    launched[-1] += rows
    return collectives(n, sizes, launched, later, step, overlap, reduced, before, tables, hooks_s=hooks,
                       finish_s=finish)[0]


def _ring_call(name: str, c: Collective, n: int) -> tuple[str, float, int]:
    """Collective `c` as ring passes (collective/program.py's ring): an all-reduce 2 passes over its bytes, an
    all-gather 1 pass over the n ranks' contributions."""
    kind, size, itemsize = c
    return (name, size * itemsize, 2) if kind == ALL_REDUCE else (name, n * size, 1)
