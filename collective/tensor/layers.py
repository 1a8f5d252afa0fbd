"""Megatron's tensor-parallel layers (Shoeybi et al. 2019, section 3) over a TensorMesh.

The conjugate operators are autograd functions: f (copy_to_tp) is the identity forward and an all-reduce of
the gradient backward; g (reduce_from_tp) all-reduces forward and is the identity backward. A column-parallel
linear (its output features split) starts with f, a row-parallel one (its input features split) ends with g,
so an MLP or attention block costs one all-reduce forward and one backward. The vocabulary is split too: the
embedding's rows (looked up where held, then g) and the head's output columns, whose cross-entropy needs only
each rank's logsumexp and target logit (gather_from_tp), never the full logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from collective.tensor.mesh import TensorMesh


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward, the gradient summed over the tensor-parallel ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: TensorMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # the gradient comes from the one linear f feeds, a fresh tensor: summed in place
        return ctx.mesh.tp_all_reduce(grad.contiguous()), None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward, the partial outputs summed over the tensor-parallel ranks (in place); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: TensorMesh) -> torch.Tensor:
        ctx.mark_dirty(x)
        return mesh.tp_all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward, every rank's 1-D tensor stacked (tp_size, n); backward, this rank's row of the gradient. Every
    rank computes the same function of the stack, so its gradient for its own row is already the whole one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: TensorMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return mesh.tp_all_gather(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.mesh.tp_rank], None


def copy_to_tp(x: torch.Tensor, mesh: TensorMesh) -> torch.Tensor:
    return _CopyToTP.apply(x, mesh)


def reduce_from_tp(x: torch.Tensor, mesh: TensorMesh) -> torch.Tensor:
    return _ReduceFromTP.apply(x.contiguous(), mesh)


def gather_from_tp(x: torch.Tensor, mesh: TensorMesh) -> torch.Tensor:
    return _GatherFromTP.apply(x, mesh)


def _parameter(t: torch.Tensor | None) -> nn.Parameter | None:
    return nn.Parameter(t.detach().clone()) if t is not None else None


@dataclass
class Adapter:
    """A LoRA adapter's parts on this rank (psarch/models/lora.py): A (r x in) and B (out x r), each whole or
    split as the layer's weight is, and its scaling alpha / r."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float


class _ParallelLinear(nn.Module):
    """A linear layer's part on this rank: `weight` and `bias` as this rank holds them (copies become its
    parameters, under the names nn.Linear and LoRALinear give them), and its LoRA adapter's parts if it has one."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mesh: TensorMesh,
                 adapter: Adapter | None = None) -> None:
        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = _parameter(bias)
        self.scaling = adapter.scaling if adapter is not None else 0.0
        self.lora_A = _parameter(adapter.lora_A if adapter is not None else None)
        self.lora_B = _parameter(adapter.lora_B if adapter is not None else None)


class ColumnParallelLinear(_ParallelLinear):
    """y_r = f(x) W_r^T + b_r: this rank's output features (rows of W and b); the output stays split. With an
    adapter (A whole, B's rows split): + s · f(A x) B_r^T, f on the rank-r activation A x, so that A's gradient
    is summed over the ranks (every rank's the same: A stays replicated)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.mesh), self.weight, self.bias)
        if self.lora_A is None or self.lora_B is None:
            return y
        return y + self.scaling * F.linear(copy_to_tp(F.linear(x, self.lora_A), self.mesh), self.lora_B)


class RowParallelLinear(_ParallelLinear):
    """y = g(x_r W_r^T) + b: this rank's input features (columns of W); the bias, whole on every rank, is added
    once, after the sum. With an adapter (A's columns split, B whole): + s · g(x_r A_r^T) B^T, the rank-r
    activation summed before B, so that B's gradient is every rank's the same (B stays replicated)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.mesh)
        y = y if self.bias is None else y + self.bias
        if self.lora_A is None or self.lora_B is None:
            return y
        return y + self.scaling * F.linear(reduce_from_tp(F.linear(x, self.lora_A), self.mesh), self.lora_B)


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + len(weight)) of the embedding: tokens held elsewhere look up zeros, and g sums them in."""

    def __init__(self, weight: torch.Tensor, lo: int, mesh: TensorMesh) -> None:
        super().__init__()
        self.mesh, self.lo = mesh, lo
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.lo
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.mesh)


class ParallelSelfAttention(nn.Module):
    """Causal self-attention over this rank's `heads` heads: q, k, v of them from a column-parallel qkv, the
    output projection row-parallel (psarch.models.gpt.CausalSelfAttention, split by heads). The two are
    ColumnParallelLinear and RowParallelLinear, or the torch peer's nn.Linear under Colwise/RowwiseParallel."""

    def __init__(self, qkv: nn.Module, proj: nn.Module, heads: int) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = qkv, proj, heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (z.view(b, s, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, lo: int,
                                 mesh: TensorMesh) -> torch.Tensor:
    """Mean cross-entropy of `target` (N,) under logits whose columns [lo, lo + V_r) this rank holds (N, V_r):
    logsumexp over the ranks' own logsumexps, less the target's logit from the rank that holds it. One
    all-gather of 2N values per rank; the backward needs no communication."""
    local = target - lo
    mine = (local >= 0) & (local < logits.shape[1])
    picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
    n = target.numel()
    both = gather_from_tp(torch.cat([torch.logsumexp(logits, dim=1), picked]), mesh)
    return (torch.logsumexp(both[:, :n], dim=0) - both[:, n:].sum(dim=0)).mean()
