"""The `tensor` backend: Megatron tensor parallelism over t ranks, data parallelism over dp = world_size / t.

Every rank builds the same full GPT (same seed), keeps its part of each parameter (collective/tensor/split.py)
and trains on its data-parallel replica's shard of the batch (TensorSpec.batch_shard). Forward and backward
all-reduce activations over the tensor-parallel group (layers.py); the loss is the vocabulary-parallel
cross-entropy. After backward the flat gradient buffer (this rank's parts, the replicated parameters' whole)
is averaged over the data-parallel group in one all-reduce. Replicated parameters (LayerNorms, position
embedding, the row-parallel linears' biases) get the same gradient on every tensor-parallel rank, summed from
the same all-reduced values, so they stay equal without communication.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from collective.tensor.layers import vocab_parallel_cross_entropy
from collective.tensor.mesh import TensorMesh
from collective.tensor.split import check_splittable, shard_plan, split_gpt
from collective.tensor.state import fragments, gather_full, written_by_me
from collective.tensor.theory import BLOCK_ACTIVATIONS
from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import Pieces, restore_optimizer, scaler_state
from psarch.config import Config
from psarch.dist import DistContext
from psarch.flat import FlatParams
from psarch.meters import SavedActivationMeter, flat_memory
from psarch.precision import MixedPrecisionOptimizer, compute_dtype
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.workload import Workload, next_token_loss


class TensorTrainer(Trainer):
    """This rank's parts of a GPT, trained with Megatron's tensor parallelism inside a data-parallel replica."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        b = cfg.backend
        self.ctx, self.cfg = ctx, cfg
        model = check_splittable(workload.model, b.tp_size)
        if workload.loss_fn is not next_token_loss:
            raise ValueError("tensor parallelism computes the GPT's next-token loss itself (vocabulary-parallel); "
                             "this workload brings its own loss_fn")
        self.mesh = TensorMesh.build(ctx, b.tp_size, b.comm)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        plan = shard_plan(shapes, self.mesh.tp_size, self.mesh.tp_rank)
        trains = {n for n, p in model.named_parameters() if p.requires_grad}
        split_gpt(model, plan, self.mesh)
        self.model = model.to(ctx.device, compute_dtype(cfg.train.precision))
        self.vocab_lo = plan["head.weight"].ranges[0][0]
        # what trains (train.trainable, LoRA) is in the flat buffer, stepped and checkpointed; the frozen parts apart
        self.shapes = {n: s for n, s in shapes.items() if n in trains}
        self.frozen_shapes = {n: s for n, s in shapes.items() if n not in trains}
        self.plan = {n: plan[n] for n in self.shapes}
        self.flat = FlatParams([p for p in self.model.parameters() if p.requires_grad])
        self.optim = MixedPrecisionOptimizer([self.flat.data], cfg.train, cfg.train.precision)
        self.activations = SavedActivationMeter(self._param_storages, scope=list(self.model.blocks)) \
            if b.measure_activations else None

    def _param_storages(self) -> set[int]:
        return {self.flat.data.untyped_storage().data_ptr()}

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        return vocab_parallel_cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                            tokens[:, 1:].reshape(-1), self.vocab_lo, self.mesh)

    def step(self, batch: Any) -> StepStats:
        self.flat.zero_grad()
        waited = self.mesh.waits.total_s
        if self.activations is None:
            loss = self._loss(batch)
        else:
            with self.activations:
                loss = self._loss(batch)
        self.optim.scaler.scale_loss(loss).backward()
        t0 = time.perf_counter()
        if self.mesh.dp is not None:
            self.flat.grad.div_(self.mesh.dp_size)   # average by pre-dividing, as DDP does
            self.mesh.dp_all_reduce(self.flat.grad)
        comm_s = time.perf_counter() - t0 + self.mesh.waits.total_s - waited
        skipped = self.optim.step([self.flat.grad])
        return StepStats(float(loss.item()), skipped=skipped, loss_scale=self.optim.scaler.scale, comm_s=comm_s,
                         extra=self._measured())

    def _measured(self) -> dict[str, float]:
        return {} if self.activations is None else {BLOCK_ACTIVATIONS: self.activations.bytes}

    # ---- the full model and checkpoints

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 model on rank 0, gathered from the first replica's tensor-parallel ranks."""
        if self.mesh.dp_rank != 0:
            return {}
        keep = self.ctx.rank == 0
        full = gather_full(self.shapes, self.optim.master.masters[0], self.mesh, keep)
        if self.frozen_shapes:
            frozen = [p.detach().reshape(-1).float() for p in self.model.parameters() if not p.requires_grad]
            full.update(gather_full(self.frozen_shapes, torch.cat(frozen), self.mesh, keep))
        order = [n for n, _ in self.model.named_parameters()]
        return {n: full[n] for n in order} if keep else {}

    def _fragments(self) -> list:
        return fragments(self.plan, self.optim.optimizer, self.optim.master.params[0])

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """This rank's parts by the full parameters' names and offsets; when writing, replicated state is dealt
        among all ranks and each part among its data-parallel replicas."""
        frags = self._fragments()
        if writing:
            frags = written_by_me(frags, self.plan, self.ctx.rank, self.ctx.world_size, self.mesh.dp_rank,
                                  self.mesh.dp_size)
        return Pieces(frags, dict(self.shapes), scaler_state(self.optim.scaler))

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        restore_optimizer(self.optim, ckpt, self._fragments)

    # ---- reports

    def memory(self) -> MemoryReport:
        return flat_memory(self.ctx.device, self.flat, self.optim.state_bytes())

    def traffic(self) -> TrafficReport:
        return self.mesh.traffic()

    def comm_waited_s(self) -> float:
        return self.mesh.waits.total_s

    def summary_extra(self) -> dict[str, Any]:
        return {"tensor_parallel": self.mesh.tp_size, "data_parallel": self.mesh.dp_size, **self._measured()}

    def close(self) -> None:
        self.mesh.close()
