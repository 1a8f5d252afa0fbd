"""Checkpoints of a parameter-server run, in psarch.checkpoint's format: every server writes its range, every
worker what it holds, in parallel (servers: psarch/ps/server/snapshots.py; workers: psarch/ps/worker/snapshots.py).
What both sides share is here.

The servers share no process group with the workers, so the `save` op is the barrier. After step K:
 1. every worker writes its part (rankR.bin/.json, its step records) into `<run>/checkpoints/.tmp_step_K`, then sends
    `save` (step K, that folder) to every server and waits for the ack;
 2. a server acks no save until every live worker has asked for step K, having pushed exactly the K steps
    (GEO: K // k_steps deltas) that precede it; each of them waits, so nothing changes the server meanwhile.
    It writes serverI.bin/.json, then acks all; a save naming any other folder is refused, and a server started
    without a run folder (`psarch server`) writes none;
 3. rank 0, acked by every server, knows every part is on disk: it merges metadata.json and renames the folder.

A server's part: its fp32 range and optimizer state by parameter name and offset (any backend can fork from
it), DC-ASGD's per-worker backups (keys "dc_backup/W"), and a JSON record with one entry per partition
(backend.partition_mb): version, the version last sent to each worker, each worker's pushes (SSP's clocks),
staleness histogram, skipped updates, loss scaler. GEO's
round accumulator is not saved: at a checkpoint every round is complete and the next push overwrites it.
A worker's part: the model it computes its next gradient on ("workerR/param"; GEO: its fp32 master, local
optimizer state and last synced model), and a record: pushes, the versions each partition last sent it, loss
scale.
With row tables (backend.embeddings = "rows") servers add their shard of every table and workers (GEO) their
row cache: psarch/ps/row_snapshot.py.

Compression: a top-k worker adds its error feedback (what its pushes left out, by partition: "workerR/topk_error"
and its record's topk_parts); GEO's servers with compressed pulls their copies of what the workers hold
(server/deltas.py: "geo_copy/W", one per worker, or one with the barrier) and whether a delta was sent.

Restoring: a checkpoint of a PS run of the same shape (`run_shape`) restores every server and worker record
exactly; any other (another backend, world size, server count, mode, GEO's compression) is a fork: the servers
take the parameters and optimizer state, every worker starts from them at step K as if it had just pulled (GEO
with compressed pulls: a whole pull, which sets the servers' copies).
"""
from __future__ import annotations

from typing import NotRequired, TypedDict

import torch

from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import Fragment
from psarch.config import Config
from psarch.ps.layout import Layout, partition_elems
from psarch.ps.messages import pulls_deltas


class RunShape(TypedDict):
    """What a PS checkpoint's records depend on (run_shape)."""

    mode: str
    world_size: int
    servers: int
    precision: str
    k_steps: int | None
    geo_barrier: bool | None
    compensation: str | None
    partition_elems: int
    partition_assignment: str
    compression: NotRequired[str]   # GEO with compressed pulls (the copies the servers keep depend on it)


class GeoRecord(TypedDict):
    """What a GEO worker's record holds of its local optimizer (GeoLocal.record)."""

    local_keys: list[str]        # its optimizer state's tensors, stored as fragments
    local_scalars: dict[str, float]
    scaler: dict[str, float]     # LossScaler.state_dict()


class RowsRecord(TypedDict, total=False):
    """What a worker's record holds of its tables (PSTables.record): GEO with rows, its RowCache's keys."""

    cache_keys: list[int]


class WorkerRecord(TypedDict):
    """A PS worker's record in a checkpoint (psarch/ps/worker/snapshots.py's pieces), with its GEO and tables' parts."""

    rank: int
    steps: int
    rounds: int
    versions: list[int]          # the version each partition last sent
    loss_scale: float
    local_keys: NotRequired[list[str]]
    local_scalars: NotRequired[dict[str, float]]
    scaler: NotRequired[dict[str, float]]
    cache_keys: NotRequired[list[int]]
    topk_parts: NotRequired[list[int]]   # top-k: the partitions whose error feedback it holds ("workerR/topk_error")


class PartitionRecord(TypedDict):
    """A server's record of one partition (ServerSnapshots.pieces): its counters and, with fp16, its loss scaler."""

    range: list[int]             # [lo, hi)
    version: int
    sent_version: list[int]      # per worker
    clock: list[int]             # per worker: its next step
    staleness: dict[str, int]    # the histogram so far
    skipped: int
    scaler: NotRequired[dict[str, float]]
    copies_moved: NotRequired[bool]   # GEO with compressed pulls: a delta was sent (WorkerCopies.moved)


class ServerRecord(TypedDict):
    """A PS server's record in a checkpoint: its partitions' records (the first's scaler, for a fork)."""

    server: int
    held: int
    max_ahead: int
    partitions: list[PartitionRecord]
    scaler: NotRequired[dict[str, float]]


class PSRecords(TypedDict):
    """A PS checkpoint's state["ps"]: the run's shape and every server's and worker's record."""

    run: RunShape
    servers: list[ServerRecord]
    workers: list[WorkerRecord]


def run_shape(cfg: Config, numel: int) -> RunShape:
    """What a PS checkpoint's records depend on (`numel`: elements of the flat vector the servers hold): a run of
    the same shape restores them exactly."""
    b, geo = cfg.backend, cfg.backend.mode == "geo"
    shape: RunShape = {"mode": b.mode, "world_size": b.world_size, "servers": b.servers,
                       "precision": cfg.train.precision, "k_steps": b.k_steps if geo else None,
                       "geo_barrier": b.geo_barrier if geo else None,
                       "compensation": b.staleness_compensation if b.mode in ("async", "ssp") else None,
                       "partition_elems": partition_elems(cfg, numel), "partition_assignment": b.partition_assignment}
    if pulls_deltas(cfg):
        shape["compression"] = cfg.train.compression
    return shape


def exact_records(ckpt: Checkpoint, cfg: Config, numel: int) -> PSRecords | None:
    """The checkpoint's PS records when it was written by a PS run of this config's shape (run_shape), else None
    (a fork: with GEO's compressed pulls, the servers learn by a whole pull what a worker holds)."""
    ps = ckpt.state.get("ps")
    return ps if ps is not None and ps["run"] == run_shape(cfg, numel) else None


def pushes_by(cfg: Config, step: int) -> int:
    """How many pushes each worker has made after `step` steps (GEO pushes once per k_steps)."""
    return step // cfg.backend.push_every


def views(layout: Layout, tensors: dict[str, torch.Tensor], lo: int, hi: int) -> list[Fragment]:
    """Fragments of flat tensors that hold elements [lo, hi) of the flat parameter vector (one key each)."""
    flat = {k: t.detach().view(-1) for k, t in tensors.items()}
    out = []
    for name, shape, start in layout:
        a, b = max(lo, start), min(hi, start + shape.numel())
        if a < b:
            out.append(Fragment(name, tuple(shape), a - start, {k: t[a - lo:b - lo] for k, t in flat.items()}))
    return out


def shapes(layout: Layout) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape by name (what a checkpoint's metadata lists)."""
    return {name: tuple(shape) for name, shape, _ in layout}
