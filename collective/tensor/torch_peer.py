"""PyTorch's own tensor parallelism as a backend (`backend.kind = "torch_tensor"`), the peer psarch's `tensor`
is checked and timed against: torch.distributed.tensor.parallel's ColwiseParallel / RowwiseParallel on a
DeviceMesh (gloo on CPU, NCCL on GPUs), as torchtitan applies them to a transformer:
- per block, attn.qkv and mlp.0 ColwiseParallel, attn.proj and mlp.2 RowwiseParallel; the fused qkv's rows
  are reordered first so that each rank's contiguous chunk is q, k and v of its own heads (torch shards a
  weight in contiguous chunks), and the attention computes on the local heads it gets;
- the token embedding RowwiseParallel (vocabulary rows), the head ColwiseParallel with its logits left
  sharded, and the loss under `loss_parallel()`;
- data parallelism beside it (world_size = dp x t, a 2-D mesh): after backward the local gradients are
  averaged over the mesh's dp dimension in one flat all-reduce, as a DDP bucket would.
Its traffic is the algorithm's volume, marked modelled: the wire is torch's. It checkpoints by the full
parameter's name and offset (psarch.checkpoint), each rank its DTensors' local shards.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from collective.comm import grads_of
from collective.tensor import theory
from collective.tensor.layers import ParallelSelfAttention
from collective.tensor.split import Shard, check_splittable, shard_plan
from collective.tensor.state import written_by_me
from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import Fragment, Pieces, local_views, restore
from psarch.config import Config
from psarch.dist import DistContext
from psarch.meters import TrafficMeter, local, torch_memory
from psarch.models.gpt import GPT, Block
from psarch.models.lora import LoRALinear
from psarch.optim import build_optimizer
from psarch.precision import step_if_finite
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.workload import Workload, next_token_loss

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def torch_plan(shapes: dict[str, tuple[int, ...]], tp_size: int, tp_rank: int) -> dict[str, Shard]:
    """psarch's split, but the vocabulary in torch.chunk's shards (ceil(V/t) rows a rank, the last fewer), as
    torch's Shard(0) places the embedding's and the head's rows."""
    plan = shard_plan(shapes, tp_size, tp_rank)
    for name in ("embed.weight", "head.weight", "head.lora_B"):
        if name not in shapes:
            continue
        rows = shapes[name][0]
        lo = min(rows, tp_rank * -(-rows // tp_size))
        plan[name] = Shard(name, shapes[name], 0, ((lo, min(rows, lo + -(-rows // tp_size))),))
    return plan


def qkv_order(shapes: dict[str, tuple[int, ...]], tp_size: int) -> dict[str, torch.Tensor]:
    """For each qkv weight and bias (and LoRA's B): the full rows in the order that puts rank r's q, k, v heads in
    its chunk."""
    plans = [shard_plan(shapes, tp_size, r) for r in range(tp_size)]
    return {name: torch.cat([torch.arange(a, b) for p in plans for a, b in p[name].ranges])
            for name in shapes if ".attn.qkv." in name and plans[0][name].dim == 0}


def parallelize(model: GPT, tp: DeviceMesh, order: dict[str, torch.Tensor], tp_size: int) -> None:
    """Apply torch's tensor parallelism to a psarch GPT on the tensor-parallel mesh `tp`, in place: qkv rows
    reordered (`order`), attention over the local heads, the plan torchtitan uses."""
    from torch.distributed.tensor import Replicate, Shard as Sharded
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, rows in order.items():
            params[name].copy_(params[name][rows])
    for block in model.blocks:
        assert isinstance(block, Block)   # check_splittable
        # a split GPT's attention changes type, in place (collective.tensor.split.split_gpt)
        block.attn = ParallelSelfAttention(  # type: ignore[assignment]
            block.attn.qkv, block.attn.proj, block.attn.n_head // tp_size)
        parallelize_module(block, tp, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                       "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
        for path, dim in (("attn.qkv", 0), ("mlp.0", 0), ("attn.proj", 1), ("mlp.2", 1)):
            place_adapter(block.get_submodule(path), tp, dim)
    parallelize_module(model, tp, {"embed": RowwiseParallel(input_layouts=Replicate()),
                                   "head": ColwiseParallel(output_layouts=Sharded(-1), use_local_output=False)})
    place_adapter(model.head, tp, 0)


def place_adapter(layer: nn.Module, tp: DeviceMesh, dim: int) -> None:
    """A LoRA adapter's factors as collective/tensor/split.py places them: ColwiseParallel (dim 0) shards every
    parameter of a linear by rows, right for B, but A is replicated; RowwiseParallel (dim 1) leaves both plain: A
    sharded by columns, B replicated. DTensor's own rules then run the adapter's forward and backward."""
    from torch.distributed.tensor import DTensor, Replicate, Shard as Sharded, distribute_tensor

    if not isinstance(layer, LoRALinear):
        return
    for name, place in (("lora_A", Sharded(1) if dim == 1 else Replicate()),
                        ("lora_B", Sharded(0) if dim == 0 else Replicate())):
        p = getattr(layer, name)
        value = p.redistribute(tp, [place]) if isinstance(p, DTensor) else distribute_tensor(p.detach(), tp, [place])
        layer.register_parameter(name, nn.Parameter(value, requires_grad=p.requires_grad))


class TorchTensorTrainer(Trainer):
    """ColwiseParallel / RowwiseParallel per block, vocabulary-parallel embedding, head and loss; the plain
    optimizer of psarch.optim over the DTensors."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        b = cfg.backend
        gpt = check_splittable(workload.model, b.tp_size)
        if workload.loss_fn is not next_token_loss:
            raise ValueError("torch_tensor trains the GPT's next-token loss under loss_parallel(); this workload "
                             "brings its own loss_fn")
        self.ctx, self.cfg, self.loss_fn = ctx, cfg, workload.loss_fn
        mesh = init_device_mesh(ctx.device.type, (b.dp_size, b.tp_size), mesh_dim_names=("dp", "tp"))
        self.dp_group = mesh["dp"].get_group() if b.dp_size > 1 else None
        self.dp_rank, self.dp_size = ctx.rank // b.tp_size, b.dp_size
        self.shapes = {n: tuple(p.shape) for n, p in gpt.named_parameters()}
        self.order = qkv_order(self.shapes, b.tp_size)
        self.plan = torch_plan(self.shapes, b.tp_size, mesh["tp"].get_local_rank())
        self.model = gpt.to(ctx.device)
        parallelize(self.model, mesh["tp"], self.order, b.tp_size)
        # what trains (train.trainable, LoRA) is stepped, reduced and checkpointed; frozen parts are only held
        trains = set(self.shapes) - {n for n, p in gpt.named_parameters() if not p.requires_grad}
        self.named = [(n, p) for n, p in self.model.named_parameters() if n in trains]
        self.params = [p for _, p in self.named]
        distributed = [p for p in self.params if hasattr(p, "to_local")]
        plain = [p for p in self.params if not hasattr(p, "to_local")]
        # one group of DTensors, one of plain tensors: a fused or foreach kernel takes one kind at a time;
        # DTensor has a sharding rule for fused AdamW, none for fused SGD (which takes the plain loop)
        self.optim = build_optimizer([{"params": distributed}, {"params": plain}], cfg.train,
                                     fused=cfg.train.optimizer == "adamw")
        self.meter = TrafficMeter(modelled=True)
        self.sent = theory.step_bytes(cfg, sum(local(p).numel() for p in self.params), torch_loss=True)[0]

    def step(self, batch: Any) -> StepStats:
        from torch.distributed.tensor.parallel import loss_parallel

        self.optim.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = self.loss_fn(self.model, batch)
            loss.backward()
        if self.dp_group is not None:
            grads = [local(g) for g in grads_of(self.params)]
            flat = torch._utils._flatten_dense_tensors(grads).div_(self.dp_size)
            dist.all_reduce(flat, group=self.dp_group)
            for g, avg in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(avg)
        skipped = step_if_finite(self.optim, [local(p.grad) for p in self.params if p.grad is not None])
        self.meter.add("all_reduce", int(self.sent), int(self.sent))
        return StepStats(float(local(loss).item()), skipped=skipped)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Each parameter gathered in turn (a collective in every tensor-parallel group); qkv rows put back in
        the model's order; rank 0 keeps fp32 CPU copies."""
        out = {}
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if self.ctx.rank == 0:
                value = full.detach().float().cpu()
                if name in self.order:
                    value = torch.empty_like(value).index_copy_(0, self.order[name], value)
                out[name] = value.clone()
        return out

    def _fragments(self) -> list[Fragment]:
        out = []
        for i, (name, p) in enumerate(self.named):
            if tuple(local(p).shape) != self.plan[name].local_shape:
                raise RuntimeError(f"torch_tensor checkpoint: {name!r} holds {tuple(local(p).shape)} here, not the "
                                   f"{self.plan[name].local_shape} of its expected shard")
            for f in self.plan[name].fragments(*local_views(self.optim, p)):
                f.holder = i
                out.append(f)
        return out

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        frags = self._fragments()
        if writing:
            frags = written_by_me(frags, self.plan, self.ctx.rank, self.ctx.world_size, self.dp_rank, self.dp_size)
        return Pieces(frags, {n: self.shapes[n] for n, _ in self.named})

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        restore(self.optim, self.params, ckpt, self._fragments)

    def memory(self) -> MemoryReport:
        return torch_memory(self.ctx.device, self.params, self.optim)

    def traffic(self) -> TrafficReport:
        return self.meter.report()

    def close(self) -> None:
        pass
