"""Activation memory of psarch's GPT blocks (psarch/models/gpt.py): the bytes one block keeps for backward.

Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models", count per block
and micro-batch, with t-way tensor parallelism and 16-bit activations, s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes.
psarch's block differs from theirs in two ways, and the formula below is theirs term by term without them:
- no dropout: the two dropout masks after attention and after the MLP (s·b·h bytes each, replicated: 2 of
  their 10) and the attention's dropout (mask and output) are not there;
- attention is torch's scaled_dot_product_attention, which keeps q, k, v, its output and the row-wise
  logsumexp (fp32, a·s·b values) and recomputes the a·s² attention matrix in backward, as the paper's
  selective recomputation does: its 5·a·s/(h·t) term (softmax output, its dropout mask and output) becomes
  4·a·s·b/t bytes of logsumexp.
What one block keeps, with w = bytes_per_value (2 in the paper):
- replicated on every tensor-parallel rank: the inputs of both LayerNorms and of the QKV and first MLP linear
  (the LayerNorms' outputs): 4·w·s·b·h (their 2 + 2 + 2 + 2 = 8 of the 10 at w = 2); each LayerNorm's
  mean and reciprocal deviation, 2·s·b values each (kept in the activations' dtype on CPU): 4·w·s·b;
- split over the t ranks: q, k and v (3·w·s·b·h/t; their 4 + 2), the attention output, which is the output
  projection's input (w·s·b·h/t; their 2), the GELU's input and the second MLP linear's input
  (4·w·s·b·h/t each; their 8 + 8): 12·w·s·b·h/t, their 24/t at w = 2; and the logsumexp, 4·a·s·b/t.
So at w = 2 the whole is s·b·h·(8 + 24/t) plus 8·s·b + 4·a·s·b/t bytes.
"""
from __future__ import annotations

LOGSUMEXP_BYTES = 4   # scaled_dot_product_attention keeps its row-wise logsumexp in fp32 whatever the dtype


def block_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, bytes_per_value: int,
                           tensor_parallel: int = 1) -> float:
    """Bytes one GPT block keeps for backward for one micro-batch of `micro_batch` sequences of `seq` tokens,
    on one rank of `tensor_parallel` that split the block (Megatron's split; 1: the whole block)."""
    s, b, h, a, w, t = seq, micro_batch, hidden, heads, bytes_per_value, tensor_parallel
    replicated = 4 * w * s * b * h + 4 * w * s * b
    split = 12 * w * s * b * h / t + LOGSUMEXP_BYTES * a * s * b / t
    return replicated + split
