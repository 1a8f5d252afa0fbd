"""What theory predicts for collective data parallelism (ddp, torch_ddp): the model replicated, gradients
all-reduced by ring, 2(N−1)/N · S per rank per step; with embedding tables moved as rows (all-gather of the
touched rows) or row-sharded over the ranks (all-to-all). The shared algebra is psarch.theory's; gradient
compression's is compression_theory.py."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from psarch.zipf import expected_unique
from psarch.theory import (BYTES, LinkBytes, MemoryPrediction, NodePrediction, Prediction, expected_unique_ids,
                           optimizer_bytes_per_param, ring_passes, sharded_memory, table_params)

if TYPE_CHECKING:
    from collective.program import Call, TableServers
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
    width = BYTES[t.precision]
    k = optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
    dense = phi - table_params(cfg)
    grads = width * phi
    if sparse_grads:
        touched = d.num_tables * expected_unique(d.rows, cfg.workload.clicks.zipf, t.global_batch * d.bag)
        grads = width * dense + touched * (8 + width * d.dim)
    mem = MemoryPrediction(params=width * phi, grads=grads, optimizer=k * phi)
    return beside_dense(ring_passes(mem, cfg, dense, 2), cfg)   # a ring all-reduce (2 passes), then the rows'


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
    return beside_dense(ring_passes(mem, cfg, dense, 2), cfg)   # a ring all-reduce (2 passes), then the rows'


def rows_link(cfg: Config) -> tuple[LinkBytes, float, float]:
    """What the tables' rows move per rank and step beside the dense layers' collectives, (bytes, rounds, messages
    in sequence), at theory's expected distinct ids per rank u: embeddings = "rows" three all-gathers (id counts,
    ids, rows: rows_all_gather_bytes), of N - 1 messages each; "sharded" four all-to-alls (counts, ids, rows,
    gradients: sharded_bytes, (N-1)/N of the u ids living elsewhere), each sending its N - 1 messages at once,
    paying the latency once. The rows move whole in the compute dtype, whatever train.compression does to the
    dense layers' buckets."""
    d, n, width = cfg.workload.dlrm, cfg.backend.world_size, BYTES[cfg.train.precision]
    if n == 1:
        return LinkBytes(), 0, 0
    u = expected_unique_ids(cfg)
    if cfg.backend.embeddings == "rows":
        v = rows_all_gather_bytes(n, d.num_tables, u, u * d.dim, width)
        return LinkBytes(v, v), 3, 3 * (n - 1)
    sent, received = sharded_bytes(u * (n - 1) / n, u * (n - 1) / n, d.num_tables, d.dim, width, n)
    return LinkBytes(sent, received), 4, 4


def beside_dense(dense: Prediction, cfg: Config, phi: float = 0.0) -> Prediction:
    """ddp's prediction with embeddings = "rows", "sharded" or "ps" from `dense`, what the dense layers' collectives
    move (uncompressed, or as train.compression does) and the memory of the model as the treatment holds it: the
    rows' bytes, rounds and messages added (rows_link); with "ps" the tables on the servers (with_ps_tables, of
    the model's `phi` parameters)."""
    if cfg.backend.embeddings == "ps":
        return with_ps_tables(dense, cfg, phi)
    link, rounds, messages = rows_link(cfg)
    mem, n = dense.memory_per_rank, cfg.backend.world_size
    if n == 1:
        return Prediction.alike(mem, LinkBytes(), n, rounds=0, messages=0)
    return Prediction.alike(mem, LinkBytes(dense.link.sent + link.sent, dense.link.received + link.received), n,
                            rounds=dense.rounds + rounds, messages=dense.messages + messages)


def ddp_bucket_shapes(cfg: Config) -> list[list[tuple[int, ...]]]:
    """The shapes of each of ddp's buckets, as collective/ddp.py lays them out (parameters in reverse order, cut at
    bucket_cap_mb; the embedding tables left out where backend.embeddings moves them apart), from the model built on
    the meta device."""
    import torch

    from collective.bucket import assign_buckets
    from psarch.embeddings import embedding_tables
    from psarch.precision import compute_dtype
    from psarch.workload import theory_model

    dtype = compute_dtype(cfg.train.precision)   # the shared model is not cast: its shapes are, as the trainer's
    model = theory_model(cfg)
    # the tables move apart from the buckets with any embeddings but "dense" (collective/embeddings.py)
    apart = {id(t.weight) for _, t in embedding_tables(model)} if cfg.backend.embeddings != "dense" else set()
    params = [torch.empty(p.shape, dtype=dtype, device="meta") for p in model.parameters()
              if p.requires_grad and id(p) not in apart][::-1]
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
    key = repr((cfg.workload, t.trainable, t.lora_rank, t.lora_targets, t.precision, cfg.backend.bucket_cap_mb,
                cfg.backend.embeddings))
    if key not in _BUCKETS:
        sizes = [sum(math.prod(s) for s in bucket) for bucket in ddp_bucket_shapes(cfg)]
        _BUCKETS[key] = (sum(sizes), [float(x) for x in sizes])
    total, elements = _BUCKETS[key]
    return [x * BYTES[t.precision] for x in elements] if total == int(phi) else None


def embedding_calls(cfg: Config) -> tuple[list[Call], list[Call], TableServers | None]:
    """What the tables' rows add to ddp's step as a program (collective/program.py's collectives), whatever averages
    the dense layers' buckets: the collectives before forward (sharded: the all-to-alls of collective/sharded.py's
    fetch, id counts, the ids asked of their owners, the rows answered), those after backward, queued behind the
    buckets' (rows: collective/rows.py's all-gathers of each rank's id counts, its u ids and their rows; sharded:
    the rows' gradients all-to-all to their owners) and the PS servers of the hybrid's tables (ps: each rank's
    rows pulled from every server before forward, their gradients pushed after backward). u is theory's
    expectation (rows_link's bytes)."""
    from collective.program import ALL_TO_ALL

    t, d, n, e = cfg.train, cfg.workload.dlrm, cfg.backend.world_size, cfg.backend.embeddings
    width, u = BYTES[t.precision], expected_unique_ids(cfg) if e != "dense" else 0.0
    if e == "rows":
        return [], [("ag_counts", n * 8.0 * d.num_tables, 1), ("ag_ids", n * 8 * u, 1),
                    ("ag_rows", n * u * d.dim * width, 1)], None
    if e == "sharded":
        away, row = u * (n - 1) / n, d.dim * width
        return [("a2a_counts", 8.0 * d.num_tables * (n - 1), ALL_TO_ALL), ("a2a_ids", 8 * away, ALL_TO_ALL),
                ("a2a_rows", row * away, ALL_TO_ALL)], [("a2a_grads", row * away, ALL_TO_ALL)], None
    return [], [], table_servers(cfg) if e == "ps" else None


def embeddings_program(cfg: Config, phi: float, step: DataStep, overlap: bool, reduced: bool) -> Program:
    """ddp with embeddings = "rows", "sharded" or "ps" as a program: the dense layers' buckets ring all-reduced from
    backward (or after it), the rows' exchanges as embedding_calls says."""
    from collective.program import collectives
    from psarch.theory.program import chunks

    dense = chunks((phi - table_params(cfg)) * BYTES[cfg.train.precision], cfg.backend.bucket_cap_mb * 2**20)
    before, after, tables = embedding_calls(cfg)
    return collectives(cfg.backend.world_size, dense, [[(f"ar{b}", size, 2)] for b, size in enumerate(dense)],
                       after, step, overlap, reduced, before, tables=tables)[0]


def table_servers(cfg: Config) -> TableServers:
    """The hybrid's tables on backend.servers PS servers (with_ps_tables): each rank's u expected rows, in fp32."""
    from collective.program import TableServers
    from psarch.ps.theory import row_bytes

    b = cfg.backend
    return TableServers(b.servers, b.server_placement == "colocated",
                        row_bytes(expected_unique_ids(cfg), cfg.workload.dlrm.dim, 4, b.servers))
