"""PyTorch's own DistributedDataParallel as a backend (`backend.kind = "torch_ddp"`): the peer that
psarch's DDP is checked against for parity and speed, driven by the same runner on the same data."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from collective.compression_theory import MIN_COMPRESSION_RATE, compressed_bucket_bytes, powersgd_plan, powersgd_work

from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import Pieces, master_fragments, restore_optimizer, scaler_state, share_of
from psarch.config import Config
from psarch.dist import DistContext
from psarch.meters import TrafficMeter, peak_memory, tensor_bytes
from psarch.precision import MixedPrecisionOptimizer, compute_dtype
from psarch.trainer import consolidated_state
from collective.comm import grads_of
from collective.embeddings import TorchSparseRows
from psarch.embeddings import EmbeddingTables
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.workload import Workload

if TYPE_CHECKING:
    from psarch.cluster.work_pacing import WorkClock


class TorchDDPTrainer(Trainer):
    """torch DDP with its defaults, `bucket_cap_mb` and `find_unused_parameters` from the config; traffic is the ring
    volume, modelled."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        self.ctx = ctx
        module = workload.model.to(ctx.device, compute_dtype(cfg.train.precision))
        sparse = cfg.backend.embeddings == "rows"   # torch's own sparse gradients (collective/embeddings.py)
        sparse_rows = TorchSparseRows(module, ctx.world_size) if sparse else None
        self.tables = sparse_rows if sparse_rows is not None else EmbeddingTables()
        self.model = DistributedDataParallel(module, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                                             process_group=ctx.group, bucket_cap_mb=cfg.backend.bucket_cap_mb,
                                             find_unused_parameters=cfg.backend.find_unused_parameters)
        self.loss_fn = workload.loss_fn
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optim = MixedPrecisionOptimizer(self.params, cfg.train, cfg.train.precision, fused=not sparse)
        self.meter = TrafficMeter(modelled=True)
        weights = {id(t.weight) for t in sparse_rows.tables} if sparse_rows is not None else set()
        self.payload = sum(p.numel() * p.element_size() for p in self.params if id(p) not in weights)
        names = {id(p): n for n, p in module.named_parameters()}
        self.named = [(names[id(p)], p) for p in self.params]
        self.compression = cfg.train.compression
        self.clock: WorkClock | None = None   # a virtual device's, for the hook's own work (pace_work)
        self.powersgd = register_compression(self.model, cfg, ctx.group, self.meter, lambda: self.clock) \
            if self.compression != "none" else None

    def pace_work(self, clock: WorkClock) -> None:
        self.clock = clock

    def step(self, batch: Any) -> StepStats:
        for p in self.params:
            p.grad = None
        loss = self.loss_fn(self.model, batch)
        self.optim.scaler.scale_loss(loss).backward()  # DDP's reducer all-reduces (averages) during backward
        n = self.ctx.world_size
        if self.compression == "none":   # compressed: the hook counts each bucket (register_compression)
            volume = 2 * (n - 1) * self.payload // n
            self.meter.add("all_reduce", volume, volume)
        extra: dict[str, float] = dict(self.tables.exchange(batch, []))   # what DDP's reducer moved of the tables' rows
        skipped = self.optim.step(grads_of(self.params))
        return StepStats(float(loss.item()), skipped=skipped, loss_scale=self.optim.scaler.scale, extra=extra)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return consolidated_state(self.model.module, dict(zip((id(p) for p in self.params), self.optim.master.masters)))

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """Replicated, like psarch's DDP: when writing, each rank writes its share."""
        frags = self._fragments()
        return Pieces(share_of(frags, self.ctx.rank, self.ctx.world_size) if writing else frags,
                      {n: tuple(p.shape) for n, p in self.named}, scaler_state(self.optim.scaler))

    def _fragments(self) -> list:
        return [f for i, (name, p) in enumerate(self.named)
                for f in master_fragments(self.optim, i, [(name, p.shape, 0)], 0, p.numel())]

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        restore_optimizer(self.optim, ckpt, self._fragments)

    def memory(self) -> MemoryReport:
        peak, kind = peak_memory(self.ctx.device)
        kept = 0 if self.powersgd is None else tensor_bytes(
            t for d in (self.powersgd.error_dict, self.powersgd.p_memory_dict, self.powersgd.q_memory_dict)
            for t in d.values())
        return MemoryReport(params=tensor_bytes(self.params), grads=tensor_bytes(p.grad for p in self.params),
                            optimizer=self.optim.state_bytes(), buffers=kept, error_feedback=kept, peak=peak,
                            peak_kind=kind)

    def traffic(self) -> TrafficReport:
        return TrafficReport({**self.meter.report().ops, **self.tables.traffic()}, modelled=True)

    def close(self) -> None:
        pass


def register_compression(model: DistributedDataParallel, cfg: Config, group: Any, meter: TrafficMeter,
                         clock: Callable[[], WorkClock | None] = lambda: None) -> PowerSGDState | None:
    """torch's own hook for train.compression (fp16_compress_hook, bf16_compress_hook, powerSGD_hook with the
    same rank, warm-up and seed as psarch's), wrapped to count each bucket's modelled bytes by
    collective/compression_theory.py's formula; the PowerSGD state, whose buffers are memory, where it is PowerSGD.
    On a virtual device (`clock()`), PowerSGD's own work is paced around torch's hook, which cannot be entered: its
    first part (powersgd_work's, up to P's all-reduce) waited in full before the hook, the rest after the hook's
    future (after Q's all-reduce); torch's real work, done between, adds its host time / D to the step."""
    t, n = cfg.train, dist.get_world_size(group)
    state: Any = group
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
    if t.compression == "powersgd":
        state = PowerSGDState(group, matrix_approximation_rank=t.powersgd_rank,
                              start_powerSGD_iter=t.powersgd_warmup_steps, min_compression_rate=MIN_COMPRESSION_RATE,
                              use_error_feedback=True, warm_start=True, random_seed=cfg.seed)
        hook = powerSGD_hook
    else:
        hook = fp16_compress_hook if t.compression == "fp16" else bf16_compress_hook

    # unannotated: DDP checks a hook's annotations as objects, and this module's are strings (__future__)
    def counted(state, bucket):  # type: ignore[no-untyped-def]
        grads = bucket.gradients()
        compressing = not isinstance(state, PowerSGDState) or state.iter >= state.start_powerSGD_iter
        volume = compressed_bucket_bytes(t.compression, [g.shape for g in grads], grads[0].element_size(), n,
                                         rank=t.powersgd_rank, compressing=compressing)
        meter.add("all_reduce", volume, volume)
        c = clock()
        if c is None or not (compressing and isinstance(state, PowerSGDState)):
            return hook(state, bucket)
        ready, before_q, after_q = powersgd_work(powersgd_plan([g.shape for g in grads], t.powersgd_rank)[1])
        with c.work(ready):
            pass
        return hook(state, bucket).then(lambda fut: _after(c, before_q + after_q, fut))

    model.register_comm_hook(state, counted)
    return state if isinstance(state, PowerSGDState) else None


def _after(clock: WorkClock, flops: float, fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    """The rest of torch's PowerSGD work paced once its hook's future is done; its value passed on."""
    with clock.work(flops):
        pass
    return fut.value()


def plain_ddp_peer(cfg: Config, device: torch.device) -> tuple[str, Any]:
    """psarch.bench.step's peer of `ddp`: torch DDP around the model, then the plain loop."""
    from psarch.bench.step import adamw, plain_step
    from psarch.workload import build_workload

    w = build_workload(cfg)
    model = DistributedDataParallel(w.model.to(device), device_ids=[device] if device.type == "cuda" else None)
    return "torch DDP", plain_step(model, w.loss_fn, adamw(model.parameters(), cfg), cfg.train.precision, device)
