"""What theory predicts for tensor parallelism (Megatron-LM) with data parallelism beside it: t ranks split each
GPT block, dp = world_size / t replicas; b = global_batch / dp sequences of s = seq_len tokens per replica,
hidden size h, L blocks, vocabulary V, activations in the compute dtype of w bytes.

Bytes per rank per step, the ring's (collective.comm.ring_bytes, exact with its padding; the native
communicator reports the same volume, modelled):
- per block, two all-reduces of b·s·h activations forward (g after the attention's and the MLP's row-parallel
  linear) and two backward (f before their column-parallel linears): 4 · 2(t−1)/t · b·s·h·w, Megatron's
  8·b·s·h·(t−1)/t elements per block;
- the vocabulary-parallel embedding's g forward and the head's f backward: 2 · 2(t−1)/t · b·s·h·w;
- the vocabulary-parallel cross-entropy's one all-gather of each rank's logsumexp and target logit, 2·b·s
  fp32 values: (t−1) · 8·b·s;
- the gradients of this rank's parameters, all-reduced over the data-parallel group: 2(dp−1)/dp · P_r·w.
Memory: parameters, gradients and optimizer state of what this rank holds, P_r (tensor-parallel rank 0's:
1/t of the split matrices and of the vocabulary, the LayerNorms, row-parallel biases and position embedding
whole), counted from the split itself (collective/tensor/split.py). Activations: L blocks of
psarch.activations.block_activation_bytes, every rank's (Prediction.per_rank). torch_tensor: the same, but
for the loss (step_bytes' torch_loss).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from collective.comm import ring_bytes
from collective.tensor.split import shard_plan
from psarch.activations import block_activation_bytes
from psarch.data.text import TextSource
from psarch.models.gpt import GPT
from psarch.theory import BYTES, LinkBytes, MemoryPrediction, NodePrediction, Prediction, optimizer_bytes_per_param

if TYPE_CHECKING:
    from psarch.config import Config
    from psarch.theory.program import DataStep, Program
LOSS_BYTES = 4   # the cross-entropy's logsumexps and target logits are fp32 whatever the compute dtype
BLOCK_ACTIVATIONS = "block_activation_bytes"   # the per-rank figure, predicted and measured under this name


def gpt_model(cfg: Config) -> GPT:
    """The config's built-in GPT on the meta device, with its LoRA adapters and frozen parameters
    (psarch.models.trainable)."""
    from psarch.models.trainable import select_trainable

    w = cfg.workload
    vocab = w.markov.vocab_size if w.data == "markov" else TextSource.vocab_size
    with torch.device("meta"):
        model = GPT(vocab, w.seq_len, w.gpt.n_layer, w.gpt.n_embd, w.gpt.n_head, w.gpt.mlp_ratio)
    select_trainable(model, cfg)
    return model


def gpt_shapes(cfg: Config, trains: bool | None = None) -> dict[str, tuple[int, ...]]:
    """The parameters (name -> shape, in order) of the config's built-in GPT, built on the meta device: all, or
    those that train (trains True) or are frozen (False)."""
    return {n: tuple(p.shape) for n, p in gpt_model(cfg).named_parameters()
            if trains is None or p.requires_grad == trains}


def held_params(cfg: Config, tp_rank: int = 0, trains: bool = True) -> tuple[int, int]:
    """(parameters that train tensor-parallel rank `tp_rank` holds, those of the whole model); trains False: the
    frozen ones."""
    shapes = gpt_shapes(cfg, trains)
    plan = shard_plan(shapes, cfg.backend.tp_size, tp_rank)
    return (sum(math.prod(s.local_shape) for s in plan.values()), sum(math.prod(s) for s in shapes.values()))


# the split linears of a GPT block: column-parallel ones start with f (an all-reduce backward), row-parallel
# ones end with g (an all-reduce forward)
COLUMNS, ROWS = ("attn.qkv", "mlp.0"), ("attn.proj", "mlp.2")


def tp_linears(cfg: Config) -> dict[str, tuple[int, int]]:
    """Per split module ("embed", each block's split linears, "head"), in forward order: (its all-reduces of b·s·h
    activations per step, of b·s·r adapter activations). Every g runs forward (the row-parallel linears' and the
    embedding's); an f's backward runs only where something before it trains (autograd skips a gradient nothing
    needs: a LoRA run's first qkv). A LoRA adapter of a split linear all-reduces its rank-r activation A x once
    (collective/tensor/layers.py). The one source of what moves: step_bytes and the program read it."""
    L = cfg.workload.gpt.n_layer
    blocks = [f"blocks.{i}.{m}" for i in range(L) for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")]
    if not (cfg.train.trainable or cfg.train.lora_rank):
        return {m: (1, 0) for m in ["embed", *blocks, "head"]}
    model = gpt_model(cfg)
    columns = {f"blocks.{i}.{c}" for i in range(L) for c in COLUMNS} | {"head"}
    linears = {"embed": (1, 0)}
    upstream = False
    for name, p in model.named_parameters():   # the forward's order in psarch's GPT
        module, _, leaf = name.rpartition(".")
        if module in columns and leaf == "weight":
            linears[module] = (int(upstream), 0)
        elif module in blocks and leaf == "weight":
            linears[module] = (1, 0)
        upstream = upstream or p.requires_grad
    return {m: (wide, int(m != "embed" and hasattr(model.get_submodule(m), "lora_A")))
            for m, (wide, _) in linears.items()}


def tp_all_reduces(cfg: Config) -> tuple[int, int]:
    """(all-reduces of b·s·h activations per step, of b·s·r adapter activations): tp_linears' summed. 4L + 2 and
    0 when all trains."""
    linears = tp_linears(cfg).values()
    return sum(w for w, _ in linears), sum(r for _, r in linears)


def step_bytes(cfg: Config, held: float, torch_loss: bool = False) -> tuple[float, int, int]:
    """(bytes one rank sends per step, which equal those it receives; ring passes; messages in sequence).
    torch_loss: torch's loss_parallel, three all-reduces of one fp32 value per token (the logits' max, the sum
    of their exponentials, the target's logit) where psarch all-gathers two."""
    b, w = cfg.backend, BYTES[cfg.train.precision]
    t, dp, g = b.tp_size, b.dp_size, cfg.workload.gpt
    tokens = cfg.train.global_batch // dp * cfg.workload.seq_len
    wide, narrow = tp_all_reduces(cfg)
    all_reduces = wide + narrow
    activations = wide * ring_bytes("all_reduce", tokens * g.n_embd, w, t)[0] + \
        narrow * ring_bytes("all_reduce", tokens * cfg.train.lora_rank, w, t)[0]
    loss = 3 * ring_bytes("all_reduce", tokens, LOSS_BYTES, t)[0] if torch_loss else \
        ring_bytes("all_gather", 2 * tokens, LOSS_BYTES, t)[0]
    grads = ring_bytes("all_reduce", int(held), w, dp)[0]
    loss_passes = 6 if torch_loss else 1
    passes = (2 * all_reduces + loss_passes if t > 1 else 0) + (2 if dp > 1 else 0)
    messages = (2 * all_reduces + loss_passes) * (t - 1) + 2 * (dp - 1)
    return activations + loss + grads, passes, messages


def tensor(cfg: Config, phi: float, torch_loss: bool = False) -> Prediction:
    """Tensor parallelism t x data parallelism dp for a run of `cfg` with `phi` parameters (the model's own
    count; another phi scales what a rank holds in proportion, for estimates); torch_loss: step_bytes'."""
    t, g = cfg.train, cfg.workload.gpt
    mine, whole = held_params(cfg)
    held = mine * phi / whole
    width, k = BYTES[t.precision], optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
    frozen = held_params(cfg, trains=False)[0] if t.trainable or t.lora_rank else 0   # its parts of the frozen
    mem = MemoryPrediction(params=width * held, grads=width * held, optimizer=k * held, frozen=width * frozen)
    v, passes, messages = step_bytes(cfg, held, torch_loss)
    acts = g.n_layer * block_activation_bytes(cfg.workload.seq_len, t.global_batch // cfg.backend.dp_size, g.n_embd,
                                              g.n_head, width, cfg.backend.tp_size)
    # every rank holds the same shapes (tensor-parallel rank 0's counted) and sends what it receives
    rank = NodePrediction(mem, LinkBytes(v, v), {BLOCK_ACTIVATIONS: acts}, ranks=range(cfg.backend.world_size))
    return Prediction({"rank": rank}, rounds=passes, messages=messages)


def program(cfg: Config, phi: float, step: DataStep, reduced: bool = False, torch_loss: bool = False) -> Program:
    """The run's step program (collective/tensor/program.py): b·s·h activations per f or g, 2·b·s fp32 values
    per rank in the loss's all-gather (torch_loss: step_bytes'), the gradients of what a rank holds (scaled to
    Φ = phi)."""
    from collective.tensor.program import tensor_program

    b, w = cfg.backend, BYTES[cfg.train.precision]
    tokens = cfg.train.global_batch // b.dp_size * cfg.workload.seq_len
    mine, whole = held_params(cfg)
    return tensor_program(b.tp_size, b.dp_size, cfg.workload.gpt.n_layer, tokens * cfg.workload.gpt.n_embd * w,
                          2 * tokens * LOSS_BYTES, mine * phi / whole * w, step, reduced, torch_loss,
                          tp_linears(cfg), tokens * cfg.train.lora_rank * w)
