"""A worker's side of checkpoints (the protocol and the format: psarch/ps/snapshot.py): the part it writes (the
model it computes on next and its record), rank 0's merge once every server has acked its save, and how a worker
continues from a checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from psarch.checkpoint import Checkpoint, Pieces, rng
from psarch.checkpoint.writer import merge, part_state, publish, step_dir, tmp_dir, write_part, write_steps
from psarch.ps.snapshot import WorkerRecord, exact_records, pushes_by, run_shape, views
from psarch.records import StepRecord

if TYPE_CHECKING:
    from psarch.ps.worker.trainer import PSWorker


def pieces(w: PSWorker) -> Pieces:
    """Worker `w`'s part: the model it computes on next (GEO: its local training state; with rows, its row cache)
    and its record (the servers write the parameters and optimizer state)."""
    w.settle()
    rank = w.ctx.rank
    own = f"worker{rank}/"
    record: WorkerRecord = {"rank": rank, "steps": w.steps, "rounds": w.rounds,
                            "versions": list(w.link.versions), "loss_scale": w.link.loss_scale}
    if w.geo is None:
        tensors = {own + "param": w.flat.data}
    else:
        tensors = w.geo.tensors(own)
        record.update(w.geo.record())
    record.update(w.tables.record())
    fragments = views(w.layout, tensors, 0, w.flat.numel) + w.tables.fragments()
    if w.topk is not None:   # its error feedback, by partition
        record["topk_parts"] = sorted(w.topk.error)
        fragments += w.topk.fragments(own, w.layout, _bounds(w))
    return Pieces(fragments, w.param_shapes, dict(record))   # the part's JSON state


def _bounds(w: PSWorker) -> list[tuple[int, int]]:
    """Each partition's [lo, hi) in the flat vector, by its index."""
    return [(p.lo, p.hi) for p in w.link.parts]


def write(w: PSWorker, root: Path, step: int, config: dict[str, Any], keep: int,
          steps: list[StepRecord] | None) -> Path:
    """Write checkpoint `step` (every worker calls it after the same step), with this rank's step records; rank 0
    merges the parts once every server has acked."""
    rank, tmp = w.ctx.rank, tmp_dir(root, step)
    tmp.mkdir(parents=True, exist_ok=True)
    part = w.checkpoint_pieces()
    write_part(part, tmp, f"rank{rank}", rng.capture(w.ctx.device))   # dropout's stream goes on
    write_steps(tmp, rank, steps)
    w.link.save(step, tmp)
    final = step_dir(root, step)
    if rank == 0:
        # every live worker wrote its part before its save; a lost worker's part is missing
        workers = [f"rank{r}" for r in range(w.n) if (tmp / f"rank{r}.json").is_file()]
        servers = [f"server{i}" for i in range(len(w.link.servers))]
        records = {p: part_state(tmp, p) for p in workers + servers}
        scaler = next((records[p]["scaler"] for p in servers + workers if "scaler" in records[p]), None)
        state = {"ps": {"run": run_shape(w.cfg, w.flat.numel), "servers": [records[p] for p in servers],
                        "workers": [records[p] for p in workers]}, **({"scaler": scaler} if scaler else {})}
        merge(tmp, workers + servers, step, config, part.params, state, w.n)
        publish(tmp, final, keep)
    return final


def load(w: PSWorker, ckpt: Checkpoint) -> None:
    """Continue worker `w` from a checkpoint: its own record exactly when this run's shape wrote it, else a fork,
    as if it had just pulled at step K."""
    ps, rank, own = exact_records(ckpt, w.cfg, w.flat.numel), w.ctx.rank, f"worker{w.ctx.rank}/"
    w.steps = ckpt.step
    rec = next((r for r in ps["workers"] if r["rank"] == rank), None) if ps is not None else None
    w.tables.restore(ckpt, rec)
    if rec is None:
        w.rounds = pushes_by(w.cfg, ckpt.step) if w.geo is not None else 0
        w.link.pull(pushes_by(w.cfg, ckpt.step))
        if w.geo is not None:   # GEO: every worker's local optimizer starts from the checkpoint's state
            w.geo.restore_fork(ckpt, w.layout)
            if w.link.synced is not None:   # compressed pulls: hold exactly what was pulled, as the servers'
                w.geo.pulled()              # copy of it does (bf16: not the checkpoint's fp32 master)
        return
    w.rounds, w.link.versions, w.link.loss_scale = rec["rounds"], list(rec["versions"]), rec["loss_scale"]
    tensors = {own + "param": w.flat.data} if w.geo is None else w.geo.restore_record(own, rec)
    with torch.no_grad():
        for f in views(w.layout, tensors, 0, w.flat.numel):
            ckpt.fill(f)
    if w.geo is not None:
        w.geo.optim.master.copy_to_model()
    if w.topk is not None:
        w.topk.restore(ckpt, own, w.layout, _bounds(w), rec.get("topk_parts", []), w.flat.grad)
