"""Data-parallel training over a Communicator: bucketed gradient all-reduce overlapped with backward.

Gradients live in one flat buffer (parameters' `.grad` are views into it), split into buckets of
`bucket_cap_mb`. A post-accumulate-grad hook marks each parameter ready; a full bucket is divided by N
and its all-reduce launched at once, in bucket order on every rank (as torch DDP's reducer does), while
backward goes on. With `overlap_comm = false` and `bucket_cap_mb = 0` this is the plain algorithm:
one all-reduce per parameter after backward. How a bucket is averaged, whole or compressed, is
collective/compression.py's (`train.compression`).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from collective.communicators import make_communicator
from collective.bucket import Bucket, assign_buckets
from collective.compression import Finish, make_compression
from collective.embeddings import make_tables
from psarch.checkpoint import Checkpoint
from psarch.cluster.work_pacing import WorkClock
from psarch.checkpoint.fragments import (Fragment, Pieces, master_fragments, restore_optimizer, scaler_state,
                                         share_of)
from psarch.config import Config
from psarch.dist import DistContext
from psarch.flat import FlatParams, flat_layout
from psarch.meters import flat_memory
from psarch.precision import MixedPrecisionOptimizer, compute_dtype
from psarch.timeline import RECORDER
from psarch.trainer import consolidated_state
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.workload import Workload

FACTOR = "compression_factor"   # a bucket's PowerSGD Q in a checkpoint (a private key: collective's own record)


def error_key(rank: int) -> str:
    """The checkpoint key of rank `rank`'s error feedback (a private key: read only by ddp)."""
    return f"error_feedback/{rank}"


class DDPTrainer(Trainer):
    """Every rank holds the whole model (its embedding tables as backend.embeddings says: collective/embeddings.py);
    gradients are averaged by all-reduce each step."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        self.ctx, self.cfg = ctx, cfg
        self.n = ctx.world_size
        self.loss_fn = workload.loss_fn
        self.comm = make_communicator(cfg.backend.comm, ctx.group)
        # before the model moves: a sharded treatment takes the (meta) tables out for its row shards, so only
        # the dense part is ever materialised on this rank
        self.tables = make_tables(workload.model, self.comm, cfg, ctx)
        self.model = workload.model.to(ctx.device, compute_dtype(cfg.train.precision))
        apart = self.tables.excluded()   # rows: the tables' gradients move as (ids, rows), not in buckets
        # Grads become ready roughly in reverse registration order: lay the buffer out that way so
        # each bucket is one contiguous slice that fills early (tables kept apart go after the buckets).
        params = [p for p in self.model.parameters() if p.requires_grad and all(p is not a for a in apart)][::-1]
        self.flat = FlatParams(params + apart)
        self.n_apart = len(apart)
        self.comm.broadcast(self.flat.data, src=0)
        self.buckets = assign_buckets(params, self.flat.offsets, cfg.backend.bucket_cap_mb * 2**20)
        self._bucket_of = {i: b for b in self.buckets for i in b.params}
        self.overlap = cfg.backend.overlap_comm
        self._next = 0
        self._finishes: list[Finish] = []
        t = cfg.train
        self.compression = make_compression(t.compression, self.comm, t.topk_ratio, t.powersgd_rank,
                                            t.powersgd_warmup_steps, cfg.seed)
        self._shapes = [[self.flat.params[i].shape for i in b.params] for b in self.buckets]
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]
        self.optim = MixedPrecisionOptimizer([self.flat.data], cfg.train, cfg.train.precision)
        self._layout = flat_layout(self.model, self.flat.params)

    def pace_work(self, clock: WorkClock) -> None:
        self.compression.clock = clock

    def _hook(self, i: int):
        def on_grad_ready(param: torch.Tensor) -> None:
            bucket = self._bucket_of[i]
            if i in bucket.ready:
                raise RuntimeError("DDP: a parameter received its gradient twice in one backward "
                                   "(shared or reused parameters are not supported)")
            bucket.ready.add(i)
            if self.overlap:
                self._launch_ready()
        return on_grad_ready

    def _launch_ready(self) -> None:
        """Launch every full bucket from the next one on, in order, so all ranks issue the same sequence."""
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        grad = self.flat.grad[bucket.start:bucket.end]
        self._finishes.append(self.compression.launch(bucket.index, grad, self._shapes[bucket.index]))
        self._next += 1

    def step(self, batch: Any) -> StepStats:
        self.flat.zero_grad()
        for b in self.buckets:
            b.ready.clear()
        self._next = 0
        t0 = time.perf_counter()
        batch = self.tables.fetch(batch)
        fetch_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        loss = self.loss_fn(self.model, batch)
        t2 = time.perf_counter()
        self.optim.scaler.scale_loss(loss).backward()
        t0 = time.perf_counter()
        RECORDER.add("compute", "forward", t1, t2)   # nothing unless the step is traced (psarch.timeline)
        RECORDER.add("compute", "backward", t2, t0)
        while self._next < len(self.buckets):  # buckets whose parameters got no gradient, or no overlap
            self._launch(self.buckets[self._next])
        # queued behind the buckets' all-reduces: every rank issues the same sequence
        grads = self.flat.views(self.flat.grad)
        extra: dict[str, float] = dict(self.tables.exchange(batch, grads[len(grads) - self.n_apart:]))
        for finish in self._finishes:   # in bucket order: PowerSGD's second all-reduce is issued here
            finish()
        self._finishes.clear()
        self.compression.end_step()
        t3 = time.perf_counter()
        comm_s = t3 - t0 + fetch_s
        RECORDER.add("waits", "all-reduce wait", t0, t3)
        # After the all-reduce every rank holds the same gradients, so the inf/nan check agrees everywhere.
        skipped = self.optim.step([self.flat.grad])
        RECORDER.add("compute", "optimizer", t3, time.perf_counter())
        self.tables.step()   # fp16 is refused with sharded tables: their step never needs a verdict
        return StepStats(float(loss.item()), skipped=skipped, loss_scale=self.optim.scaler.scale, comm_s=comm_s,
                         extra=extra)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        masters = self.flat.views(self.optim.master.masters[0])
        state = consolidated_state(self.model, {id(p): m for p, m in zip(self.flat.params, masters)})
        tables = self.tables.full_tables()   # tables the model does not hold, under their names (collective)
        # the tables' own win over the model's (ps: its tables hold only the last step's rows)
        return {**state, **tables} if self.ctx.rank == 0 else {}

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """Every rank holds every dense parameter; when writing, each writes its share (and the rows its
        treatment holds itself)."""
        frags = self._fragments()
        mine = share_of(frags, self.ctx.rank, self.n) if writing else frags
        params = {n: tuple(s) for n, s, _ in self._layout[::-1]}
        return Pieces(mine + self.tables.fragments() + self._compression_fragments(),
                      {**self.tables.params(), **params}, scaler_state(self.optim.scaler))

    def _compression_fragments(self) -> list[Fragment]:
        """The compression's state (train.compression): this rank's error feedback by parameter, under a key of
        its own rank (each rank writes its own), and each bucket's Q (every rank's alike: rank 0 writes it)
        under the bucket's first parameter, from offset 0 (its own numbering, not the parameter's elements)."""
        out = []
        for b, error in self.compression.errors().items():
            bucket = self.buckets[b]
            for i in bucket.params:
                name, shape, at = self._layout[i]
                lo = at - bucket.start
                out.append(Fragment(name, tuple(shape), 0, {error_key(self.ctx.rank): error[lo:lo + shape.numel()]}))
        if self.ctx.rank == 0:
            for b, q in self.compression.factors().items():
                name, shape, _ = self._layout[self.buckets[b].params[0]]
                out.append(Fragment(name, tuple(shape), 0, {f"{FACTOR}/{b}": q}))
        return out

    def _restore_compression(self, ckpt: Checkpoint) -> None:
        """The compression's state from the checkpoint, where it holds this rank's (a resumed run; a fork onto
        another world size or an uncompressed run's checkpoint starts it fresh)."""
        errors, factors = {}, {}
        grad = self.flat.grad
        same_world = ckpt.meta.get("world_size") == self.n   # another world's residuals are not this one's
        for bucket in self.buckets if same_world else []:
            names = [self._layout[i] for i in bucket.params]
            if all(ckpt.has(name, error_key(self.ctx.rank)) for name, _, _ in names):
                errors[bucket.index] = torch.cat([ckpt.read(name, error_key(self.ctx.rank), 0, shape.numel())
                                                  for name, shape, _ in names]).to(grad.device, grad.dtype)
            first = names[0][0]
            numel = ckpt.numel(first, f"{FACTOR}/{bucket.index}")
            if numel:
                factors[bucket.index] = ckpt.read(first, f"{FACTOR}/{bucket.index}", 0, numel).to(grad.device,
                                                                                                 grad.dtype)
        self.compression.restore(ckpt.step, errors, factors)

    def _fragments(self) -> list:
        return master_fragments(self.optim, 0, self._layout, 0, self.flat.numel)

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        restore_optimizer(self.optim, ckpt, self._fragments)
        self.tables.load_checkpoint(ckpt)
        self._restore_compression(ckpt)

    def save_services(self, step: int, folder: Path) -> list[str]:
        return self.tables.save_services(step, folder)   # ps: the servers' rows

    def memory(self) -> MemoryReport:
        report = flat_memory(self.ctx.device, self.flat, self.optim.state_bytes())
        report.error_feedback = self.compression.state_bytes()
        report.buffers += report.error_feedback
        for k, v in self.tables.memory().items():
            setattr(report, k, getattr(report, k) + v)
        return report

    def traffic(self) -> TrafficReport:
        report = self.comm.traffic.report()
        # all_to_all is torch's: its bytes are the payload's, so modelled
        return TrafficReport({**report.ops, **self.tables.traffic()}, modelled=report.modelled or self.tables.modelled())

    def summary_extra(self) -> dict[str, Any]:
        return self.tables.summary()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.tables.close()
        self.comm.close()
