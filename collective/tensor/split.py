"""Which part of each parameter of psarch's GPT a tensor-parallel rank holds (Megatron's split), and the cut of
a built model into those parts.

Column-parallel (output features split, rows of the weight and of the bias): the attention's qkv, its q, k and
v each cut by heads, and the MLP's first linear. Row-parallel (input features split, columns of the weight):
the attention's output projection and the MLP's second linear; their biases are added after the sum, whole on
every rank. The vocabulary's rows of the token embedding and of the head are split as evenly as they go
(rank r holds [r·V//t, (r+1)·V//t)). LayerNorms and the position embedding are replicated. Pure arithmetic
here, no communication: `shard_plan` of any rank can be computed anywhere (the full model's gather does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from collective.tensor.layers import (Adapter, ColumnParallelLinear, ParallelSelfAttention, RowParallelLinear,
                                      VocabParallelEmbedding)
from collective.tensor.mesh import TensorMesh
from psarch.checkpoint.fragments import Fragment
from psarch.models.gpt import GPT, Block, CausalSelfAttention
from psarch.models.lora import LoRALinear

# module path inside a block -> (split dimension of its weight, how many equal parts its output rows hold)
BLOCK_SPLITS = {"attn.qkv": (0, 3), "mlp.0": (0, 1), "attn.proj": (1, 1), "mlp.2": (1, 1)}
VOCAB = ("embed", "head")
# a LoRA adapter (psarch/models/lora.py) of a split linear: B (out x r) splits as the weight's rows (a
# column-parallel linear), A (r x in) as its columns (a row-parallel one); the other factor is replicated
ADAPTER_SPLIT = {"lora_B": 0, "lora_A": 1}


@dataclass(frozen=True)
class Shard:
    """The part of a full parameter `name` (shape `shape`) a rank holds: along dimension `dim`, the ranges
    `ranges` of the full parameter, one after another (dim None: the whole parameter, replicated)."""

    name: str
    shape: tuple[int, ...]
    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        held = sum(b - a for a, b in self.ranges)
        return self.shape[:self.dim] + (held,) + self.shape[self.dim + 1:]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor (a copy where it is several ranges)."""
        if self.dim is None:
            return full
        return torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.ranges], dim=self.dim)

    def put(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write this rank's part `local` (shaped local_shape) into its place in `full`."""
        if self.dim is None:
            full.copy_(local)
            return
        at = 0
        for a, b in self.ranges:
            full.narrow(self.dim, a, b - a).copy_(local.narrow(self.dim, at, b - a))
            at += b - a

    def fragments(self, tensors: dict[str, torch.Tensor], scalars: dict[str, float]) -> list[Fragment]:
        """Checkpoint fragments of this part, from flat views of it (`tensors`: the master and optimizer state):
        each row range one flat range of the full parameter; a column range a column block (Fragment.columns)."""
        if self.dim is None:
            return [Fragment(self.name, self.shape, 0, tensors, dict(scalars))]
        if self.dim == 1:
            (a, b), = self.ranges
            return [Fragment(self.name, self.shape, a, tensors, dict(scalars), columns=(a, b))]
        row = math.prod(self.shape[1:])
        out, at = [], 0
        for a, b in self.ranges:
            piece = {k: t[at * row:(at + b - a) * row] for k, t in tensors.items()}
            out.append(Fragment(self.name, self.shape, a * row, piece, dict(scalars)))
            at += b - a
        return out


def vocab_range(vocab: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of a vocabulary of `vocab` tokens on rank `tp_rank`: as even as they go, none empty."""
    return tp_rank * vocab // tp_size, (tp_rank + 1) * vocab // tp_size


def _shard(name: str, shape: tuple[int, ...], tp_size: int, tp_rank: int) -> Shard:
    module, _, leaf = name.rpartition(".")
    inner = module.split(".", 2)[2] if module.startswith("blocks.") else ""
    if leaf in ADAPTER_SPLIT:
        split = 0 if module in VOCAB else BLOCK_SPLITS[inner][0] if inner in BLOCK_SPLITS else None
        if split != ADAPTER_SPLIT[leaf]:
            return Shard(name, shape)
    if module in VOCAB:
        return Shard(name, shape, 0, (vocab_range(shape[0], tp_size, tp_rank),))
    if inner not in BLOCK_SPLITS or (name.endswith(".bias") and BLOCK_SPLITS[inner][0] == 1):
        return Shard(name, shape)
    dim, parts = BLOCK_SPLITS[inner]
    size = shape[dim] // parts // tp_size
    return Shard(name, shape, dim, tuple((p * shape[dim] // parts + tp_rank * size,
                                          p * shape[dim] // parts + (tp_rank + 1) * size) for p in range(parts)))


def shard_plan(shapes: dict[str, tuple[int, ...]], tp_size: int, tp_rank: int) -> dict[str, Shard]:
    """Every parameter of a psarch GPT (name -> full shape, in the model's order) -> the part rank `tp_rank` of
    `tp_size` holds."""
    return {name: _shard(name, tuple(shape), tp_size, tp_rank) for name, shape in shapes.items()}


def check_splittable(model: nn.Module, tp_size: int) -> GPT:
    """A psarch GPT whose heads and vocabulary split `tp_size` ways, returned as one; else one line saying
    what is supported."""
    if type(model) is not GPT or not all(type(b) is Block and type(b.attn) is CausalSelfAttention
                                         for b in model.blocks):
        raise ValueError(f"tensor parallelism splits psarch's built-in GPT (workload.model = \"gpt\"); this model is "
                         f"a {type(model).__name__}")
    first = model.blocks[0] if len(model.blocks) else None
    heads = first.attn.n_head if isinstance(first, Block) else tp_size
    if heads % tp_size or model.embed.num_embeddings < tp_size:
        raise ValueError(f"tensor_parallel = {tp_size}: must divide the GPT's {heads} heads and be at most its "
                         f"vocabulary of {model.embed.num_embeddings} tokens")
    return model


def split_gpt(model: GPT, plan: dict[str, Shard], mesh: TensorMesh) -> None:
    """Replace the model's split layers, in place, by their parallel versions holding this rank's parts; the
    parameters keep their names and order."""
    params = dict(model.named_parameters())

    def part(name: str) -> torch.Tensor:
        return plan[name].take(params[name].detach())

    def bias(path: str) -> torch.Tensor | None:
        return part(f"{path}.bias") if f"{path}.bias" in params else None

    def adapter(path: str) -> Adapter | None:
        layer = model.get_submodule(path)
        return Adapter(part(f"{path}.lora_A"), part(f"{path}.lora_B"), layer.scaling) \
            if isinstance(layer, LoRALinear) else None

    def column(path: str) -> ColumnParallelLinear:
        return ColumnParallelLinear(part(f"{path}.weight"), bias(path), mesh, adapter(path))

    def row(path: str) -> RowParallelLinear:
        return RowParallelLinear(part(f"{path}.weight"), bias(path), mesh, adapter(path))

    trains = {name: p.requires_grad for name, p in params.items()}

    for i, block in enumerate(model.blocks):
        assert isinstance(block, Block)   # check_splittable
        at = f"blocks.{i}"
        # the layers are replaced, in place, by their parallel versions: a split GPT's layers change type
        block.attn = ParallelSelfAttention(column(f"{at}.attn.qkv"), row(f"{at}.attn.proj"),  # type: ignore[assignment]
                                           block.attn.n_head // mesh.tp_size)
        block.mlp = nn.Sequential(column(f"{at}.mlp.0"), block.mlp[1], row(f"{at}.mlp.2"))
    lo = plan["embed.weight"].ranges[0][0]
    model.embed = VocabParallelEmbedding(part("embed.weight"), lo, mesh)   # type: ignore[assignment]  # as above
    model.head = column("head")   # type: ignore[assignment]  # as above
    for name, p in model.named_parameters():   # the parts train where the whole did (train.trainable, LoRA)
        p.requires_grad_(trains[name])
