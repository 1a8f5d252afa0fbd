"""Activation memory of a transformer block: the bytes autograd keeps for backward, after Korthikanti et al.
(2022), "Reducing Activation Recomputation in Large Transformer Models", adapted to psarch's GPT block
(psarch/models/gpt.py: pre-LayerNorm, fused causal attention, GELU MLP of width 4h, no dropout).

What one block of psarch's GPT saves for backward, per micro-batch of b sequences of s tokens, hidden size
h, a heads, B bytes per value (the compute dtype), s·b·h values each unless said:

    ln1: its input x, and mean and rstd per token (2·s·b values)     1
    qkv linear: its input (ln1's output)                             1
    attention (fused scaled_dot_product_attention): q, k, v          3
        its output (which proj takes as input: one storage)          1
        and the log-sum-exp of each row, fp32 (a·s·b × 4 bytes)
    ln2: its input, and mean and rstd per token                      1
    fc1: its input (ln2's output)                                    1
    GELU: its input (fc1's output, 4h wide)                          4
    fc2: its input (GELU's output)                                   4
                                                                    --
                                                                    16 · s·b·h·B + s·b·(4·B + 4·a) bytes

The paper's 34·s·b·h + 5·a·s²·b (bytes, 2-byte values, dropout) counts the same 16 values per token
(32 bytes: its Q and K, V, the output projection's input where we have q, k, v and one attention output),
plus two 1-byte dropout masks (2·s·b·h) that a model without dropout does not keep, plus the unfused
attention's softmax output, dropout mask and dropout output (2 + 1 + 2 bytes per element of the a·s·s
scores: 5·a·s²·b): a fused kernel keeps none of them, only the log-sum-exp per row, and recomputes the
scores in backward (the paper's selective recomputation, done by the kernel). The layer norms' statistics,
which the paper leaves out, are counted here: B bytes each on a CPU, as measured (fp32 on a GPU, 8 bytes
more per token in bf16: under 0.5% of a block from h = 64).

Tensor parallelism (Megatron's t-way split, no sequence parallelism): the layer norms' inputs and the
inputs of the column-parallel linears (qkv, fc1) stay whole on every rank (4 values, and the statistics);
q, k, v, the attention output, the GELU's input and output (12 values) and the log-sum-exp are split by
heads and columns, 1/t each: 4 + 12/t values, the paper's 10 + 24/t with its masks taken out.
"""
from __future__ import annotations

VALUES_REPLICATED = 4      # ln1 and ln2 inputs, qkv and fc1 inputs: whole on every tensor-parallel rank
VALUES_SPLIT = 12          # q, k, v, attention output, GELU input (4h), fc2 input (4h): 1/t each


def block_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, bytes_per_value: int,
                           tensor_parallel: int = 1) -> float:
    """Bytes one GPT block keeps for backward per micro-batch of `micro_batch` sequences of `seq` tokens, on
    one of `tensor_parallel` ranks (Megatron's split of heads and MLP columns, no sequence parallelism)."""
    for name, value in (("seq", seq), ("micro_batch", micro_batch), ("hidden", hidden), ("heads", heads),
                        ("bytes_per_value", bytes_per_value), ("tensor_parallel", tensor_parallel)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"block_activation_bytes: {name} = {value!r}, expected an integer >= 1")
    if heads % tensor_parallel:
        raise ValueError(f"block_activation_bytes: tensor_parallel = {tensor_parallel} must divide heads = {heads}")
    tokens, t, width = seq * micro_batch, tensor_parallel, bytes_per_value
    values = tokens * hidden * (VALUES_REPLICATED + VALUES_SPLIT / t) * width
    stats = tokens * (2 * 2 * width + 4 * heads / t)   # two norms' mean and rstd; log-sum-exp per head, fp32
    return values + stats
