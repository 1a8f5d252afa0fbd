"""What theory predicts for collective data parallelism (ddp, torch_ddp): the model replicated, gradients
all-reduced by ring, 2(N−1)/N · S per rank per step; with embedding tables moved as rows (all-gather of the
touched rows) or row-sharded over the ranks (all-to-all). The shared algebra is psarch.theory's."""
from __future__ import annotations

from typing import TYPE_CHECKING

from psarch.zipf import expected_unique
from psarch.theory import (BYTES, LinkBytes, MemoryPrediction, Prediction, expected_unique_ids,
                           optimizer_bytes_per_param, ring_passes, sharded_memory, table_params)

if TYPE_CHECKING:
    from psarch.config import Config


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
        return Prediction(mem, LinkBytes(), None, rounds=0, messages=0, server_memory=None)
    u = expected_unique_ids(cfg)
    v = 2 * (n - 1) / n * dense * width + rows_all_gather_bytes(n, d.num_tables, u, u * d.dim, width)
    # a ring all-reduce (2 passes), then three all-gathers: id counts, ids, rows
    return Prediction(mem, LinkBytes(v, v), None, rounds=5, messages=5 * (n - 1), server_memory=None)


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
        return Prediction(mem, LinkBytes(), None, rounds=0, messages=0, server_memory=None)
    u = expected_unique_ids(cfg)
    sent, received = sharded_bytes(u * (n - 1) / n, u * (n - 1) / n, d.num_tables, d.dim, width, n)
    ring = 2 * (n - 1) / n * dense * width
    # two ring passes of N - 1 messages in sequence; each all-to-all (counts, ids, rows, gradients) sends
    # its N - 1 messages at once, paying the latency once
    return Prediction(mem, LinkBytes(ring + sent, ring + received), None, rounds=2 + 4,
                      messages=2 * (n - 1) + 4, server_memory=None)
