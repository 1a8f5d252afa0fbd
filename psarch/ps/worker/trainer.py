"""The `ps` backend's worker: computes gradients, pushes them to the servers, pulls parameters back.

A worker holds the model's parameters and gradients only; the optimizer runs on the servers (in GEO
each worker also runs a local optimizer, as in PaddlePaddle's GEO-SGD: geo.py). Parameters and gradients
live in one flat buffer (`FlatParams`); server i owns the contiguous slice `ranges[i]` of it (link.py). With
`backend.embeddings = "rows"` its embedding treatment (tables.py) is a `WorkerRows` (rows.py): the tables stay on
the servers and each step fetches and pushes only the rows its batch reads.

Precision: workers compute in the compute dtype and push gradients (GEO: deltas) in it; servers keep
fp32 parameters and optimizer state, and answer pulls in the compute dtype. So the wire carries
S = Φ·bytes(compute dtype) each way, as theory's traffic assumes. In fp16 the loss scale is
the servers' (sent with every pull); the worker checks its whole gradient for inf/nan and sends the
verdict with the push, so that every server skips the same steps.

Checkpoints (the protocol: psarch/ps/snapshot.py; the worker's side: snapshots.py): each worker writes its part,
then its `save` to every server is the barrier; rank 0 merges the parts once every server has acked.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from psarch.checkpoint import Checkpoint, Pieces
from psarch.cluster.work_pacing import WorkClock
from psarch.config import Config
from psarch.dist import DistContext
from psarch.errors import check_loss
from psarch.flat import FlatParams, flat_layout
from psarch.meters import peak_memory, tensor_bytes
from psarch.precision import compute_dtype, has_inf_or_nan
from psarch.records import StepRecord
from psarch.timeline import RECORDER
from psarch.ps.errors import WorkerLost
from psarch.ps.layout import push_dtype, server_partitions, trainable
from psarch.ps.partitions import replicas
from psarch.ps.theory import compressing_bytes
from psarch.ps.messages import pulls_deltas, pushes_from_hooks
from psarch.ps.worker import snapshots
from psarch.ps.worker.client import PSClient
from psarch.ps.worker.geo import GeoLocal
from psarch.ps.worker.link import Exchange, ServerLink
from psarch.ps.worker.priority import PriorityPushes, PullOrder
from psarch.ps.worker.rows import WorkerRows
from psarch.ps.worker.tables import PSTables
from psarch.ps.worker.topk import TopKPushes
from psarch.ps.worker.schedule import PushSchedule
from psarch.trainer import consolidated_state
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.workload import Workload


class PSWorker(Trainer):
    """One PS worker (modes sync, async, ssp, geo; see psarch/ps/server/ for what servers do)."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        b = cfg.backend
        self.cfg, self.ctx, self.n = cfg, ctx, b.world_size
        self.dtype = compute_dtype(cfg.train.precision)
        self.fp16 = cfg.train.precision == "fp16"
        addresses = list(ctx.services.addresses or b.server_addresses)
        if len(addresses) != b.servers:
            raise RuntimeError(f"backend.servers = {b.servers}: {len(addresses)} server address(es) known "
                               f"({addresses}); run through `psarch run`, or list every server in "
                               f"backend.server_addresses")
        self.client = PSClient(addresses, ctx.rank, b.timeout_s, ctx.services.auth, b.heartbeat_s,
                               b.heartbeat_timeout_s, failover=bool(replicas(cfg)), resend_s=b.resend_timeout_s)
        # every parameter a checkpoint holds (with rows: the tables too, which this worker never holds whole)
        self.param_shapes = {n: tuple(p.shape) for n, p in workload.model.named_parameters() if p.requires_grad}
        # the tables leave the model before it moves: only the dense part is ever materialised here
        self.tables = (WorkerRows(workload.model, cfg, self.client, self.dtype, ctx.device, ctx.rank)
                       if b.embeddings == "rows" else PSTables())
        self.model = workload.model.to(ctx.device, self.dtype)
        self.loss_fn = workload.loss_fn
        self.flat = FlatParams(trainable(self.model))
        self.layout = flat_layout(self.model, self.flat.params)
        self.topk = TopKPushes(cfg.train.topk_ratio, lambda numel: compressing_bytes(cfg, numel)) \
            if cfg.train.compression == "topk" else None
        self.link = ServerLink(self.client, self.flat, server_partitions(cfg, self.flat.numel), ctx.device, self.dtype,
                               push_dtype(cfg), self.topk, replicas(cfg))
        # sync, dense tables, one exchange a step: a worker dropped from rounds that went on without it comes back
        # (with replicas too: each partition's first holder decides the round it is taken back at, its followers sum
        # what its commits name, psarch/ps/replication.py)
        self.rejoins = b.mode == "sync" and b.embeddings != "rows" and not b.priority_credit_mb
        self.steps = 0        # steps taken (after a rejoin: the round it was taken back at)
        self.rounds = 0       # geo: deltas pushed
        if not ctx.services.restored:   # else load_checkpoint sets the state
            self.link.pull(0)  # the servers built the same initial model from the config: nothing to send
        self.geo = GeoLocal(self.flat, cfg) if b.mode == "geo" else None   # from the pulled model
        if self.geo is not None and pulls_deltas(cfg):   # pulls add compressed deltas to the model it holds
            self.link.synced = self.geo.synced
        self.schedule = (PushSchedule(self.flat.params, self.flat.offsets, self.link.parts)
                         if pushes_from_hooks(cfg) else None)
        self.pushes = self.pull_order = None
        if b.priority_credit_mb:
            self.pushes = PriorityPushes(self.link, int(b.priority_credit_mb * 2**20))
            self.pull_order = PullOrder(self.model, self.link, {id(p): o for p, o in
                                                                zip(self.flat.params, self.flat.offsets)},
                                        self.pushes)

    # ------------------------------------------------------------------ steps

    def step(self, batch: Any) -> StepStats:
        t_start = time.time()
        t0 = time.perf_counter()
        batch = self.tables.fetch(batch)
        fetch_s = time.perf_counter() - t0
        if self.pushes is None:   # with priority: after forward (the last pushes may still be reading the gradient)
            self.flat.zero_grad()
        t1 = time.perf_counter()
        loss = self.loss_fn(self.model, batch)
        RECORDER.add("compute", "forward", t1, time.perf_counter())   # nothing unless traced (psarch.timeline)
        if not self.fp16:  # before the push: name the bad loss rather than have a server refuse its gradient
            check_loss(self.steps, self.ctx.rank, float(loss.detach()))
        try:
            info = self._geo_step(self.geo, loss, batch) if self.geo is not None else self._push_step(loss, batch)
        except WorkerLost as e:   # sync: dropped from rounds that went on without it (a pause): come back
            if not self.rejoins:
                raise
            info = self._rejoin(e)
        info["comm_s"] += fetch_s
        scale = self.geo.optim.scaler.scale if self.geo is not None else self.link.loss_scale
        said = (("version", info.get("version")), ("staleness", info.get("staleness")), ("ahead", info.get("ahead")),
                ("rejoined_at", info.get("rejoined_at")))
        extra: dict[str, float] = {k: v for k, v in said if v is not None}
        extra.update(info["tables"], t_start=t_start, t_end=time.time())
        return StepStats(float(loss.item()), skipped=bool(info.get("skipped", False)), loss_scale=scale,
                         comm_s=info["comm_s"], extra=extra)

    def _push_step(self, loss: torch.Tensor, batch: Any) -> Exchange:
        """sync, async, ssp: push this step's gradient (after its rows'), pull the parameters for the next; with
        overlap_comm each partition is pushed from backward's hooks as soon as its gradients are final."""
        if self.pushes is not None:
            return self._priority_step(self.pushes, loss, batch)
        if self.schedule is not None:   # dense tables only (pushes_from_hooks): their exchange moves nothing
            step = self.steps + 1
            self.schedule.arm(lambda part: self.link.post(part, self.flat.grad, step, {}))
            t1 = time.perf_counter()
            loss.backward()
            since = time.perf_counter()   # the wait after backward is the step's communication time
            RECORDER.add("compute", "backward", t1, since)
            figures = self.tables.exchange(batch, [])
            self.schedule.finish()
            self.steps += 1
            info = self.link.settle(since)
            RECORDER.add("waits", "pull wait", since, time.perf_counter())
            info["tables"] = figures
            return info
        t1 = time.perf_counter()
        (loss * self.link.loss_scale if self.fp16 else loss).backward()
        RECORDER.add("compute", "backward", t1, time.perf_counter())
        header: dict[str, Any] = {}
        if self.fp16:
            header = {"scale": self.link.loss_scale, "found_inf": bool(has_inf_or_nan([self.flat.grad]).item())}
        figures = self.tables.exchange(batch, [])
        before = self.tables.before_push(self.steps, self.link.server_versions())
        self.steps += 1
        t1 = time.perf_counter()
        info = self.link.exchange(self.flat.grad, self.steps, header, before)
        RECORDER.add("waits", "push-pull wait", t1, time.perf_counter())
        info["tables"] = figures
        return info

    def _rejoin(self, lost: WorkerLost) -> Exchange:
        """This step's push was refused: a round went on without this worker (psarch/ps/server/readmit.py). Take
        every reply of the exchange, ask every server to take it back at the round after the newest they named,
        pull that round's parameters and take that step next (next_step): this step's gradient counts for
        nothing, and the rounds between were the others' alone."""
        t0 = time.perf_counter()
        at = self.link.rejoin(max(self.link.abandon(lost)) + 1)
        self.steps = at
        return {"comm_s": time.perf_counter() - t0, "version": at, "rejoined_at": at, "tables": {}}

    def next_step(self, step: int) -> int:
        """The step after `step`, or the round a dropped worker was taken back at (_rejoin)."""
        return max(step + 1, self.steps)

    def _priority_step(self, pushes: PriorityPushes, loss: torch.Tensor, batch: Any) -> Exchange:
        """Priority (priority.py): the previous exchange settled (forward took most of its pulls and posted most
        of its queued pushes), pushes queued from backward's hooks and sent lowest partition first, as far as
        the credit allows; the rest, and the pulls, are left to the next forward. What the step reports
        (version, staleness) is the previous exchange's; its communication time is the wait to settle that,
        the wait after backward and the next forward's waits."""
        schedule, pull_order = self.schedule, self.pull_order
        assert schedule is not None and pull_order is not None   # priority pushes from hooks, pulls before forward
        t0 = time.perf_counter()
        info = self.settle()
        settled = time.perf_counter() - t0
        self.flat.zero_grad()
        pushes.arm(self.steps + 1)
        schedule.arm(pushes.add)
        loss.backward()
        since = time.perf_counter()
        figures = self.tables.exchange(batch, [])   # dense tables only (pushes_from_hooks): nothing moves
        schedule.finish()
        pushes.pump()
        self.steps += 1
        waited, pull_order.waited_s = pull_order.waited_s, 0.0
        info["comm_s"], info["tables"] = time.perf_counter() - since + waited + settled, figures
        return info

    def settle(self) -> Exchange:
        """Priority: post the pushes still queued and take the rest of the exchange in flight (if any); what its
        replies said."""
        if self.pushes is None or not (any(self.link.posted) or self.pushes.ready):
            return {"comm_s": 0.0}
        self.pushes.flush()
        return self.link.settle(acks=self.pushes.acks)

    def _geo_step(self, geo: GeoLocal, loss: torch.Tensor, batch: Any) -> Exchange:
        """GEO: a local step (dense part, then the tables' own: the cached rows); a sync every k_steps."""
        geo.optim.scaler.scale_loss(loss).backward()
        skipped = geo.optim.step([self.flat.grad])
        self.tables.step()
        self.steps += 1
        info: Exchange = {"comm_s": 0.0, "skipped": skipped}
        if self.steps % self.cfg.backend.push_every == 0:
            info.update(self._geo_sync(geo))
            info["skipped"] = skipped
        info["tables"] = self.tables.exchange(batch, [])   # after the sync: the rows it pushed
        return info

    def _geo_sync(self, geo: GeoLocal) -> Exchange:
        """Push delta = (local − last synced) / N (after the changed rows' deltas), pull the servers' model and
        continue from it."""
        before = self.tables.before_push(self.rounds, self.link.server_versions())
        delta = geo.delta(self.n, self.dtype)
        self.rounds += 1
        try:
            info = self.link.exchange(delta, self.rounds, {}, before)
        finally:
            self.tables.pushed()
        geo.pulled(deltas=self.link.synced is not None)
        return info

    # ------------------------------------------------------------------ the model

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0: the servers' fp32 parameters (after GEO's last partial round; with rows, the servers' rows).
        Every rank then tells the servers it is done."""
        if self.geo is not None and self.steps % self.cfg.backend.push_every:
            self._geo_sync(self.geo)
        self.settle()
        state: dict[str, torch.Tensor] = {}
        if self.ctx.rank == 0:   # tables the model does not hold, from the servers, under their names
            masters = {id(p): v for p, v in zip(self.flat.params, self.flat.views(self.link.fetch()))}
            state = {**consolidated_state(self.model, masters), **self.tables.full_tables()}
        self.link.done()
        return state

    # ------------------------------------------------------------------ checkpoints (snapshots.py)

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """This worker's part: the model it computes on next and its record (snapshots.pieces)."""
        return snapshots.pieces(self)

    def write_checkpoint(self, ctx: DistContext, root: Path, step: int, config: dict[str, Any], keep: int,
                         steps: list[StepRecord] | None) -> Path:
        """Write checkpoint `step` (every worker calls it after the same step), with this rank's step records."""
        return snapshots.write(self, Path(root), step, config, keep, steps)

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        """Continue from a checkpoint (the servers restored themselves when they started): snapshots.load."""
        snapshots.load(self, ckpt)

    # ------------------------------------------------------------------ figures

    def memory(self) -> MemoryReport:
        peak, kind = peak_memory(self.ctx.device)
        optimizer, synced = self.geo.memory() if self.geo is not None else (0, 0)
        # a GPU worker's host staging copy for the wire is host memory, not model state on the device
        kept = self.topk.state_bytes() if self.topk is not None else 0   # top-k's error feedback
        m = MemoryReport(params=tensor_bytes([self.flat.data]), grads=tensor_bytes([self.flat.grad]),
                         optimizer=optimizer, buffers=synced + kept, error_feedback=kept, peak=peak, peak_kind=kind)
        for k, v in self.tables.memory().items():
            setattr(m, k, getattr(m, k) + v)
        return m

    def traffic(self) -> TrafficReport:
        return self.client.meter.report()

    def pace_work(self, clock: WorkClock) -> None:
        if self.topk is not None:
            self.topk.clock = clock
        if self.pull_order is not None:
            self.pull_order.clock = clock

    def comm_waited_s(self) -> float:
        """Priority: the next forward's waits for its modules' pulls (forward pre-hooks) are communication, not
        compute: a virtual device moves its deadlines past them and does not count them as its compute."""
        return self.pull_order.total_s if self.pull_order is not None else 0.0

    def summary_extra(self) -> dict[str, Any]:
        self.settle()
        out: dict[str, Any] = {"ps_versions": list(self.link.versions)}
        if replicas(self.cfg):   # chain replication: the servers it went on without (ServerLink.failovers)
            out["failovers"] = self.link.failovers()
        return dict(out, **self.tables.summary())

    def close(self) -> None:
        for hooks in (self.schedule, self.pull_order):
            if hooks is not None:
                hooks.remove()
        self.client.close()
