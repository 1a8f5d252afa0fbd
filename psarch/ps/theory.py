"""What theory predicts for the parameter server: each worker pushes S (gradients; GEO: deltas) and pulls S
each exchange, split evenly over the servers; with embedding tables sharded by row over the servers, only
the rows a batch touches move. The shared algebra is psarch/theory.py's."""
from __future__ import annotations

from typing import Any

from psarch.theory import (BYTES, LinkBytes, MemoryPrediction, Prediction, expected_unique_ids,
                           optimizer_bytes_per_param, table_params)

Config = Any


def dense(cfg: Config, phi: float) -> Prediction:
    """Each worker pushes S and pulls S, split evenly over the servers; GEO does so once every k_steps steps
    and keeps a local optimizer and the last synced fp32 model. A server holds its fp32 range and, except in
    GEO (deltas are added), the optimizer state for it; barrier modes sum a round's pushes in an fp32
    accumulator; delay compensation keeps the version last sent to each worker. Not counted: the pushes a
    barrier server keeps while it waits for a predecessor's (it sums in worker order): none at a round's
    end, at worst (N - 1) x width x its range mid-round (worker 0 last); how many depends on arrival order,
    so servers report their peak."""
    b, t = cfg.backend, cfg.train
    n, width = b.world_size, BYTES[t.precision]
    s, every = phi * width, b.push_every
    k = optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
    per_server = n * s / b.servers / every
    server_per_param = 4 + (0 if b.mode == "geo" else optimizer_bytes_per_param(t.optimizer, "fp32", t.momentum))
    server_per_param += 4 if b.barrier else 0
    server_per_param += 4 * n if b.mode in ("async", "ssp") and b.staleness_compensation == "dc" else 0
    server_mem = server_per_param * phi / b.servers
    if b.mode == "geo":
        mem = MemoryPrediction(params=width * phi, grads=width * phi, optimizer=k * phi, buffers=4 * phi)
    else:
        mem = MemoryPrediction(params=width * phi, grads=width * phi, optimizer=0.0)
    return Prediction(mem, LinkBytes(s / every, s / every), LinkBytes(per_server, per_server),
                      rounds=2 / every, messages=2 / every, server_memory=server_mem)


def rows_traffic(u: float, dim: int, dense_params: float, width: int) -> LinkBytes:
    """One PS worker's bytes per exchange with embedding rows: it sends the keys of its u distinct rows
    twice (8 B each, with the row pull and with the row push, which names its rows) and u rows of
    gradients (GEO: deltas), receives u rows, and pushes and pulls the dense part (headers not counted)."""
    return LinkBytes(sent=u * dim * width + 16 * u + dense_params * width,
                     received=u * dim * width + dense_params * width)


def rows(cfg: Config, phi: float) -> Prediction:
    """The embedding tables sharded by row over the servers (psarch/ps/rows.py): a worker holds the dense
    parameters and the u rows of its step (and their gradients); each server a 1/S share of the dense part
    and of every table, with their optimizer state; traffic from rows_traffic with the expected u, spread
    evenly over the servers (keys are hashed to servers). GEO exchanges once every k steps the rows its k
    batches read (u_k of them: each is pulled once, when first read, and its delta pushed at the sync), and
    keeps them, their pulled copies and their local optimizer state."""
    b, t, d = cfg.backend, cfg.train, cfg.workload.dlrm
    width, n, geo = BYTES[t.precision], b.world_size, b.mode == "geo"
    every = b.push_every
    table = table_params(cfg)
    dense_params, u = phi - table, expected_unique_ids(cfg, every)
    once = rows_traffic(u, d.dim, dense_params, width)
    link = LinkBytes(once.sent / every, once.received / every)
    k = 0 if geo else optimizer_bytes_per_param(t.optimizer, "fp32", t.momentum)
    # the dense range's round accumulator (a round's rows are held only until the round ends; like the
    # pushes kept early for worker-order sums, at worst (N - 1) x width x the dense range, they are not counted)
    barrier = 4 if b.barrier else 0
    steps = 8 * d.num_tables * d.rows if t.optimizer == "adamw" and not geo else 0   # lazy AdamW's step per row
    server_mem = ((4 + k + barrier) * dense_params + (4 + k) * table + steps) / b.servers
    held = u * d.dim * width
    if geo:   # + the dense part's local optimizer and last synced copy, as a dense GEO worker
        kl = optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
        u1 = expected_unique_ids(cfg)
        mem = MemoryPrediction(params=(dense_params + u * d.dim) * width, grads=(dense_params + u1 * d.dim) * width,
                               optimizer=kl * (dense_params + u * d.dim), buffers=4 * (dense_params + u * d.dim) + 8 * u)
    else:
        mem = MemoryPrediction(params=dense_params * width + held, grads=dense_params * width + held, optimizer=0.0)
    # a server receives what workers send and sends what they receive; phases: row pull, rows, push, pull
    return Prediction(mem, link, LinkBytes(sent=n * link.received / b.servers, received=n * link.sent / b.servers),
                      rounds=4 / every, messages=4 / every, server_memory=server_mem)
