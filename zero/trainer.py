"""The `zero` backend: ZeRO stages 1, 2 and 3 over a psarch communicator (ring or native).

One trainer for the three stages; what differs lives in the engines: zero.stage1.Stage1 and
zero.stage2.Stage2 (full parameters, partitioned gradients, on zero.stage12's shared schedule) and
zero.stage3.Stage3 (partitioned parameters gathered per unit).
Either hands the optimizer this rank's chunks only, so fp32 master weights and optimizer state exist for
1/N of the model. Mixed precision is psarch's MixedPrecisionOptimizer over those chunks; since a rank
sees only its gradient chunk, the fp16 overflow check is made global by all-reducing one fp32 flag (fp16
only) so every rank skips the same steps and keeps the same loss scale. On the ring that one element is
padded to N chunks of one element: 2(N-1)·4 bytes sent per rank per step, counted on the wire.
Saved activations are measured only when `backend.measure_activations` asks: the meter hooks every tensor
autograd saves, which costs step time nobody else should pay.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from collective.communicators import make_communicator
from collective.ps_tables import PSTableRows
from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import Pieces, master_fragments, restore_optimizer, scaler_state
from psarch.config import Config
from psarch.dist import DistContext
from psarch.meters import SavedActivationMeter, peak_memory, tensor_bytes
from psarch.precision import MixedPrecisionOptimizer, compute_dtype, has_inf_or_nan
from psarch.timeline import RECORDER
from psarch.trainer import consolidated_state
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.embeddings import EmbeddingTables
from psarch.workload import Workload
from zero.stage3 import Stage3
from zero.stage1 import Stage1
from zero.stage2 import Stage2
from zero.theory import forward_order, unit_sizes
from psarch.model_units import Unit, checkpoint_units, find_units


class ZeroTrainer(Trainer):
    """ZeRO data parallelism: optimizer state (stage 1), + gradients (2), + parameters (3) partitioned."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        b = cfg.backend
        self.ctx, self.cfg, self.stage = ctx, cfg, b.stage
        # embeddings = "ps" (the hybrid, collective/ps_tables.py): the tables on PS servers, taken out of the model
        # (empty frozen placeholders) before it moves; else dense, the default treatment's no-ops
        self.tables = PSTableRows(workload.model, cfg, ctx) if b.embeddings == "ps" else EmbeddingTables()
        self.model = workload.model.to(ctx.device, compute_dtype(cfg.train.precision))
        self.loss_fn = workload.loss_fn
        self.comm = make_communicator(b.comm, ctx.group)
        # stage 3 shards frozen weights too (zero/frozen.py): every block that holds a parameter is then a unit
        self.units = find_units(self.model, b.zero_units, frozen_too=self.stage == 3)
        self.params = [p for u in self.units for p in u.params]
        self.phi = sum(p.numel() for p in self.params)
        if b.activation_checkpointing:
            checkpoint_units(self.units)
        if self.stage == 3:
            self.engine: Stage1 | Stage2 | Stage3 = Stage3(self.model, self.units, self.comm,
                                                            b.prefetch_bucket_size, b.overlap_comm,
                                                            cfg.train.compression, _forward_order(cfg, self.units))
        else:
            unit_of = {id(p): i for i, u in enumerate(self.units) for p in u.params}
            stages: dict[int, type[Stage1] | type[Stage2]] = {1: Stage1, 2: Stage2}
            self.engine = stages[self.stage](
                [p for p in self.model.parameters() if p.requires_grad], self.comm, b.reduce_bucket_size,
                b.overlap_comm, b.allgather_bucket_size, unit_of, cfg.train.compression)
        self.optim = MixedPrecisionOptimizer(self.engine.param_shards(), cfg.train, cfg.train.precision)
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        self.activations = SavedActivationMeter(self._param_storages) if b.measure_activations else None
        self._hooks = []
        self._metering = False
        meter = self.activations
        if meter is not None and b.activation_checkpointing:
            for u in self.units:  # a checkpointed unit keeps its inputs: count them as saved
                if u.module is not None:
                    self._hooks.append(u.module.register_forward_pre_hook(
                        lambda m, args: meter.count_inputs(args) if self._metering else None))

    def _param_storages(self) -> set[int]:
        if isinstance(self.engine, Stage3):
            full = [*self.engine.full, *self.engine.frozen.full.values()]
            return {f.untyped_storage().data_ptr() for f in full if f.untyped_storage().nbytes()}
        return {self.engine.flat.untyped_storage().data_ptr()}

    def step(self, batch: Any) -> StepStats:
        self.engine.begin_step()
        engine = self.engine
        f0 = time.perf_counter()
        batch = self.tables.fetch(batch)
        t1 = time.perf_counter()
        fetch_s = t1 - f0
        with engine.reads_outside_forward() if isinstance(engine, Stage3) else contextlib.nullcontext():
            if self.activations is None:
                loss = self.loss_fn(self.model, batch)
            else:
                self._metering = True
                with self.activations:
                    loss = self.loss_fn(self.model, batch)
                self._metering = False
        t2 = time.perf_counter()
        self.optim.scaler.scale_loss(loss).backward()
        t0 = time.perf_counter()
        # nothing unless the step is traced (psarch.timeline); stage 3's gathers block inside these spans
        RECORDER.add("compute", "forward", t1, t2)
        RECORDER.add("compute", "backward", t2, t0)
        extra: dict[str, float] = dict(self.tables.exchange(batch, []))   # the rows' gradients to their servers
        self.engine.reduce_gradients()
        grads = self.engine.grad_shards()
        # fp32/bf16: None, the optimizer checks this rank's chunks; a rank whose chunk holds inf/nan refuses
        # the step and stops the run, its peers then fail waiting for it (no flag crosses the wire)
        found_inf = self._found_inf_anywhere(grads) if self.optim.scaler.enabled else None
        t3 = time.perf_counter()
        RECORDER.add("waits", "reduce-scatter wait", t0, t3)
        skipped = self.optim.step(grads, found_inf=found_inf)
        t4 = time.perf_counter()
        RECORDER.add("compute", "optimizer", t3, t4)
        if not skipped and not isinstance(self.engine, Stage3):
            self.engine.gather_params()
            RECORDER.add("waits", "all-gather wait", t4, time.perf_counter())
        comm_s = time.perf_counter() - t0 + fetch_s
        return StepStats(float(loss.item()), skipped=skipped, loss_scale=self.optim.scaler.scale, comm_s=comm_s,
                         extra={**extra, **self._saved_activations()})

    def _saved_activations(self) -> dict[str, float]:
        return {} if self.activations is None else {"saved_activation_bytes": self.activations.bytes}

    def _found_inf_anywhere(self, grads: list[torch.Tensor]) -> bool:
        flag = has_inf_or_nan(grads).reshape(1).to(torch.float32)
        self.comm.all_reduce(flag)
        return bool(flag.item() > 0)

    # ---- checkpoints

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated fp32 CPU model on rank 0 ({} elsewhere); a collective call, one group (within one
        unit) at a time."""
        with self.comm.traffic.tagged("export"):  # no training step's traffic: booked as export_all_gather
            values = self.engine.full_params(self.optim.master.masters, keep=self.ctx.rank == 0)
        tables = self.tables.full_tables()   # ps: rank 0's, from the servers (the model holds a step's rows)
        return {**consolidated_state(self.model, values, copy=False), **tables} if self.ctx.rank == 0 else {}

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """This rank's chunk of every group, by parameter name: each rank writes (and holds) its own shard."""
        held = {id(p) for p in self.params}
        params = {n: tuple(p.shape) for n, p in self.model.named_parameters() if id(p) in held}
        # ps: the tables, whose rows their servers write (save_services)
        return Pieces(self._fragments() + self.tables.fragments(), {**self.tables.params(), **params},
                      scaler_state(self.optim.scaler))

    def _fragments(self) -> list:
        part, r = self.engine.part, self.ctx.rank
        out = []
        for g in part.groups:
            layout = [(self.names[id(p)], p.shape, o) for p, o in zip(g.params, g.offsets)]
            # stages 1-2: the optimizer was given one chunk per group; stage 3: one tensor, the whole shard
            i, base = (0, g.shard_start) if self.stage == 3 else (g.index, 0)
            out += master_fragments(self.optim, i, layout, r * g.chunk, (r + 1) * g.chunk, base)
        return out

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        """Fill this rank's chunks from any checkpoint; stages 1-2 then all-gather the full parameters (collective)."""
        restore_optimizer(self.optim, ckpt, self._fragments)
        self.tables.load_checkpoint(ckpt)   # ps: the step its servers' rows are at (they restored them)
        if not isinstance(self.engine, Stage3):
            self.engine.gather_params()

    def save_services(self, step: int, folder: Path) -> list[str]:
        return self.tables.save_services(step, folder)   # ps: the servers' rows

    # ---- reports

    def memory(self) -> MemoryReport:
        e, rank = self.engine, self.ctx.rank
        item = e.shard.element_size() if isinstance(e, Stage3) else e.flat.element_size()
        pad_full, pad_shard = e.part.padding * item, e.part.shard_padding(rank) * item
        frozen = 0   # stages 1-2: the frozen weights are the model's, whole (the runner measures them)
        if isinstance(e, Stage3):
            params, grads = tensor_bytes([e.shard]), tensor_bytes([e.shard_grad])
            frozen = tensor_bytes([e.frozen.shard])   # this rank's chunk of each unit's frozen weights
            padding = 2 * pad_shard + e.frozen.part.shard_padding(rank) * item
        else:
            params = tensor_bytes([e.flat])
            grads = tensor_bytes([e.grad]) if isinstance(e, Stage1) else tensor_bytes([e.shard_grad])
            padding = pad_full + (pad_full if isinstance(e, Stage1) else pad_shard)
        peak, kind = peak_memory(self.ctx.device)
        rows = self.tables.memory()   # ps: the last step's rows and their gradients
        params, grads = params + rows.get("params", 0), grads + rows.get("grads", 0)
        return MemoryReport(params=params, grads=grads, optimizer=self.optim.state_bytes(), frozen=frozen,
                            working=e.transient.peak.get("working", 0),
                            gathered_peak=e.transient.peak.get("gathered", 0),
                            grad_buffer_peak=e.transient.peak.get("grads", 0),
                            peak=peak, peak_kind=kind, padding=padding + self._optimizer_padding())

    def _optimizer_padding(self) -> int:
        """Bytes of optimizer state (masters included) that belong to padding elements of this rank's chunks."""
        e, rank = self.engine, self.ctx.rank
        chunks = ([e.part.shard_padding(rank)] if isinstance(e, Stage3)
                  else [g.chunk_padding(rank) for g in e.part.groups])
        return sum(chunks) * self.optim.state_bytes_per_element()

    def traffic(self) -> TrafficReport:
        report = self.comm.traffic.report()
        return TrafficReport({**report.ops, **self.tables.traffic()}, modelled=report.modelled)

    def comm_waited_s(self) -> float:
        return self.engine.waits.total_s

    def summary_extra(self) -> dict[str, Any]:
        e = self.engine
        return {"zero_groups": len(e.part.groups), "zero_padded_params": e.part.padded_numel,
                "zero_group_numel": [g.numel for g in e.part.groups], "zero_working_peak": e.transient.peak.get("working", 0),
                "zero_reduced_in_backward": e.reduced_in_backward, "zero_prefetched": getattr(e, "prefetched", 0),
                **self._saved_activations(), **self.tables.summary()}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.tables.close()
        self.engine.close()
        self.comm.close()


def _forward_order(cfg: Config, units: list[Unit]) -> list[int]:
    """The order forward runs the units in (zero.theory.forward_order: one forward on the meta device, the source the
    step program reads too), checked to name these units."""
    if len(unit_sizes(cfg)) != len(units):
        raise RuntimeError(f"ZeRO-3: the model has {len(units)} units, its meta copy {len(unit_sizes(cfg))}; "
                           "the model must be built the same on the meta device")
    return forward_order(cfg)
