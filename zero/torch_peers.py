"""PyTorch's own ZeRO implementations as backends, the peers psarch's ZeRO is checked and timed against:

- `torch_zero`: torch DDP + `torch.distributed.optim.ZeroRedundancyOptimizer` (ZeRO-1: each rank keeps
  the optimizer state of its share of the parameters; after its local step each rank broadcasts its
  updated parameters). DDP all-reduces gradients in full, so its traffic is 3(N-1)/N S, not ZeRO-1's 2.
- `torch_fsdp`: FSDP2 `fully_shard` on every unit (psarch.model_units: the model's blocks), then on the root
  (ZeRO-3). Gloo on CPU works; NCCL on GPUs.

Both checkpoint by parameter name and flat offset (psarch.checkpoint): torch_zero's ranks write the
parameters whose optimizer state they own, torch_fsdp's ranks their DTensors' local shards.

Both run fp32 (what parity and the benchmark need), with the optimizer class and hyper-parameters of
psarch.optim.build_optimizer. train.compression = "fp16" | "bf16" casts the gradients' collective to 2 bytes, as
psarch's ZeRO does (zero/wire.py): torch_zero's DDP takes torch's fp16_compress_hook / bf16_compress_hook (the same
mapping as torch_ddp's, collective/torch_ddp.py), torch_fsdp reduce-scatters in that dtype
(MixedPrecisionPolicy(reduce_dtype=...), the parameters kept fp32). Traffic is the algorithm's volume, marked
modelled: the wire is torch's.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from collective.torch_ddp import register_compression
from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import PARAM, Fragment, Pieces, local_views, restore, whole_parameters
from psarch.config import Config
from psarch.dist import DistContext
from psarch.meters import TrafficMeter, local, optimizer_state_bytes, peak_memory, tensor_bytes, torch_memory
from psarch.optim import build_optimizer
from psarch.precision import DTYPES, step_if_finite
from psarch.theory import BYTES
from psarch.trainer import consolidated_state
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.workload import Workload
from psarch.model_units import find_units
from zero.theory import fsdp2_forward_only, gradient_width, never_run


def optimizer_spec(cfg: Config) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The class and keyword arguments build_optimizer would use (for optimizers that build their own)."""
    import inspect

    probe = build_optimizer([torch.zeros(1, requires_grad=True)], cfg.train)
    accepted = inspect.signature(type(probe).__init__).parameters  # defaults may hold internal keys
    return type(probe), {k: v for k, v in probe.defaults.items() if k in accepted}


class TorchZeroTrainer(Trainer):
    """torch DDP with ZeroRedundancyOptimizer over build_optimizer's optimizer; train.compression's hook on the DDP."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.ctx = ctx
        module = workload.model.to(ctx.device)
        self.model = DistributedDataParallel(module, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                                             process_group=ctx.group, bucket_cap_mb=cfg.backend.bucket_cap_mb)
        self.loss_fn = workload.loss_fn
        self.params = [p for p in module.parameters() if p.requires_grad]
        cls, kwargs = optimizer_spec(cfg)
        self.optim = ZeroRedundancyOptimizer(self.params, optimizer_class=cls, process_group=ctx.group, **kwargs)
        self.meter = TrafficMeter(modelled=True)
        self.payload = sum(p.numel() * p.element_size() for p in self.params)
        self.compressed = cfg.train.compression != "none"
        if self.compressed:   # the hook counts each bucket's all-reduce in 2 bytes
            register_compression(self.model, cfg, ctx.group, self.meter)

    def step(self, batch: Any) -> StepStats:
        for p in self.params:
            p.grad = None
        loss = self.loss_fn(self.model, batch)
        loss.backward()        # DDP all-reduces (averages) the gradients during backward
        # local step on this rank's parameters, then each rank broadcasts its own
        skipped = step_if_finite(self.optim, [p.grad for p in self.params if p.grad is not None])
        n = self.ctx.world_size
        if not self.compressed:
            self.meter.add("all_reduce", 2 * (n - 1) * self.payload // n, 2 * (n - 1) * self.payload // n)
        self.meter.add("broadcast", (n - 1) * self.payload // n, (n - 1) * self.payload // n)
        return StepStats(float(loss.item()), skipped=skipped)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return consolidated_state(self.model.module, {}) if self.ctx.rank == 0 else {}

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """Each rank writes the parameters whose optimizer state it owns (ZeroRedundancyOptimizer's
        partition); it holds every parameter's value besides."""
        names = {id(p): n for n, p in self.model.module.named_parameters()}
        owned = self._owned()
        frags = whole_parameters(self.optim.optim, owned, [(names[id(p)], p) for p in owned])
        if not writing:
            mine = {id(p) for p in owned}
            frags += [Fragment(names[id(p)], tuple(p.shape), 0, {PARAM: p.detach().view(-1)}, holder=-1)
                      for p in self.params if id(p) not in mine]
        return Pieces(frags, {names[id(p)]: tuple(p.shape) for p in self.params})

    def _owned(self) -> list[torch.Tensor]:
        return [p for g in self.optim.optim.param_groups for p in g["params"]]

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        restore(self.optim.optim, self._owned(), ckpt, lambda: self.checkpoint_pieces(writing=False).fragments)

    def memory(self) -> MemoryReport:
        peak, kind = peak_memory(self.ctx.device)
        return MemoryReport(params=tensor_bytes(self.params), grads=tensor_bytes(p.grad for p in self.params),
                            optimizer=optimizer_state_bytes(self.optim.optim), peak=peak, peak_kind=kind)

    def traffic(self) -> TrafficReport:
        return self.meter.report()

    def close(self) -> None:
        pass


def _row_offset(name: str, p: torch.Tensor) -> int:
    """The flat offset of this rank's FSDP2 shard of `p`: FSDP2 shards dim 0 as torch.chunk does (ceil(d0/N) rows a
    rank, the last ranks fewer or none), so a rank holds rows [r * chunk, r * chunk + local rows)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        raise ValueError(f"torch_fsdp checkpoint: parameter {name!r} is not a DTensor (not sharded by fully_shard)")
    if tuple(p.placements) != (Shard(0),):
        raise ValueError(f"torch_fsdp checkpoint: parameter {name!r} is placed {p.placements}, not sharded on dim 0 "
                         f"over a 1-D mesh; such a layout cannot be written")
    n, rows = p.device_mesh.size(), p.shape[0]
    start = min(p.device_mesh.get_local_rank() * -(-rows // n), rows)
    if start + p.to_local().shape[0] > rows:
        raise ValueError(f"torch_fsdp checkpoint: parameter {name!r} holds {p.to_local().shape[0]} rows from row "
                         f"{start} of {rows}, not torch.chunk's shard")
    return start * math.prod(p.shape[1:])


class TorchFSDPTrainer(Trainer):
    """FSDP2: fully_shard per unit, then the root; build_optimizer over the sharded (DTensor) parameters; with
    train.compression the gradients reduce-scattered in its 2-byte dtype."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.ctx = ctx
        self.model = workload.model.to(ctx.device)
        mesh = (DeviceMesh.from_group(ctx.group, ctx.device.type) if ctx.group is not None
                else init_device_mesh(ctx.device.type, (ctx.world_size,)))
        compression = cfg.train.compression
        # param_dtype None: the parameters stay fp32, only the gradients' reduce-scatter is cast (as zero/wire.py)
        policy = MixedPrecisionPolicy(reduce_dtype=None if compression == "none" else DTYPES[compression])
        # frozen weights (train.trainable, LoRA's base) are sharded with their unit, as psarch's ZeRO-3 shards them:
        # FSDP2 takes a group of mixed requires_grad, all-gathers all of it and reduce-scatters the gradients there are
        for unit in find_units(self.model, cfg.backend.zero_units, frozen_too=True)[1:]:
            if unit.module is not None:   # only the root unit's is None
                fully_shard(unit.module, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)
        self.loss_fn = workload.loss_fn
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        # DTensor has a sharding rule for fused AdamW, none for fused SGD or Adagrad: those take the plain loop
        self.optim = build_optimizer(self.params, cfg.train, fused=cfg.train.optimizer == "adamw")
        self.meter = TrafficMeter(modelled=True)
        self.payload = sum(p.numel() * p.element_size() for p in self.params)
        self.grad_payload = sum(p.numel() for p in self.params) * gradient_width(cfg)
        self.frozen_payload = sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.requires_grad)
        # the root (kept gathered through backward) and the frozen weights of the units backward never reaches (nor
        # prefetches) are gathered in forward only
        self.once_payload = sum(fsdp2_forward_only(cfg)) * BYTES[cfg.train.precision]
        idle, idle_frozen = never_run(cfg)   # units forward never runs: FSDP2 neither gathers nor reduces them
        self.payload -= idle * BYTES[cfg.train.precision]
        self.frozen_payload -= idle_frozen * BYTES[cfg.train.precision]
        self.grad_payload -= idle * gradient_width(cfg)

    def step(self, batch: Any) -> StepStats:
        self.optim.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model, batch)
        loss.backward()        # FSDP reduce-scatters (averages) gradients per unit during backward
        skipped = step_if_finite(self.optim, [local(p.grad) for p in self.params if p.grad is not None])
        n, s, f = self.ctx.world_size, self.payload, self.frozen_payload
        gathered = (n - 1) * (2 * (s + f) - self.once_payload) // n
        self.meter.add("all_gather", gathered, gathered, calls=2)
        g = self.grad_payload
        self.meter.add("reduce_scatter", (n - 1) * g // n, (n - 1) * g // n)
        return StepStats(float(loss.item()), skipped=skipped)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Each tensor gathered in turn (a collective); rank 0 keeps the fp32 copies."""
        out = {}
        for name, value in self.model.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            if self.ctx.rank == 0:
                out[name] = full.detach().float().cpu().clone() if full.is_floating_point() else full.detach().cpu().clone()
        return out

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """Each rank writes (and holds) its own FSDP2 shard of every parameter: its DTensor's local rows."""
        return Pieces(self._fragments(), {n: tuple(p.shape) for n, p in self.named})

    def _fragments(self) -> list[Fragment]:
        out = []
        for i, (name, p) in enumerate(self.named):
            if local(p).numel() == 0:   # a rank past the last row of a small parameter holds none of it
                continue
            tensors, scalars = local_views(self.optim, p)
            out.append(Fragment(name, tuple(p.shape), _row_offset(name, p), tensors, scalars, i))
        return out

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        """Fill this rank's shard (parameters and optimizer state) from a checkpoint of any backend and size."""
        restore(self.optim, self.params, ckpt, self._fragments)

    def memory(self) -> MemoryReport:
        return torch_memory(self.ctx.device, self.params, self.optim)

    def traffic(self) -> TrafficReport:
        return self.meter.report()

    def close(self) -> None:
        pass


def plain_fsdp2_peer(cfg: Config, device: torch.device) -> tuple[str, Any]:
    """psarch.bench.step's peer of `zero` (stage 3): FSDP2 fully_shard on each unit psarch's ZeRO-3 gathers,
    then the root (bf16: MixedPrecisionPolicy(param_dtype=bf16)), then the plain loop."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from psarch.bench.step import adamw, plain_step
    from psarch.precision import compute_dtype
    from psarch.workload import build_workload

    w = build_workload(cfg)
    model = w.model.to(device)   # fp32 weights: FSDP's policy computes in low precision
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype(cfg.train.precision), reduce_dtype=torch.float32)
    for unit in find_units(model, cfg.backend.zero_units):
        if unit.module is not None and unit.module is not model:
            fully_shard(unit.module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return "FSDP2", plain_step(model, w.loss_fn, adamw(model.parameters(), cfg), "fp32", device)
