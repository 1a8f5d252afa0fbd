"""Tensor parallelism's step as a program (psarch.theory.program): t ranks split each GPT block, dp replicas.

Each rank computes its 1/t of the replica's step (`step`, what one rank computes). Forward: the
vocabulary-parallel embedding's all-reduce (g), then per block the attention's share of the compute (1/3 of a
block's matrices), the all-reduce of its output (g), the MLP's share (2/3), its all-reduce (g); then the
cross-entropy's all-gather of the logsumexps and target logits. Backward, in reverse: per block the MLP's
backward, the all-reduce of its input's gradient (f), the attention's, its all-reduce (f); then the head's (f).
With frozen parameters or LoRA, an f that nothing upstream needs is skipped and each adapter adds an all-reduce
of its rank-r activation (theory's tp_linears). Every collective is a ring over the t ranks of the replica,
waited on before the next compute (Megatron's f and g are synchronous). After backward, the rank's gradients are
ring all-reduced over the dp ranks of its tensor-parallel position, then the optimizer steps.

Full: replica d's tensor-parallel rank k is node d·t + k. Reduced: every rank alike, one node standing for all.
"""
from __future__ import annotations

from collections.abc import Mapping

from collective.program import ring
from psarch.theory.program import WORKER, DataStep, Program

ATTENTION = 1 / 3   # of a block's compute: its 4h² of the 12h² matrices (the MLP the 8h²)


def tensor_program(t: int, dp: int, layers: int, activation: float, loss: float, grads: float, step: DataStep,
                   reduced: bool = False, torch_loss: bool = False,
                   linears: Mapping[str, tuple[int, int]] | None = None, adapter: float = 0.0) -> Program:
    """t-way tensor parallelism x dp: `activation` the bytes of one f or g all-reduce (b·s·h values), `loss` the
    bytes each rank contributes to the loss's all-gather, `grads` a rank's gradient bytes; `step` what one rank
    computes (the blocks alike). torch_loss: torch's loss_parallel,
    three all-reduces of `loss` / 2 bytes each (one fp32 per token) in place of psarch's all-gather. linears: per
    split module, its all-reduces of `activation` and of `adapter` bytes (collective/tensor/theory.py's tp_linears;
    None: every f and g, no adapter)."""
    p = Program()
    n = t * dp
    for _ in range(1 if reduced else n):
        p.node(WORKER, n if reduced else 1)
    groups = [[0]] if reduced else [[d * t + k for k in range(t)] for d in range(dp)]
    last: dict[int, tuple[str, ...]] = {node: () for g in groups for node in g}
    fwd, bwd = step.forward_s / max(1, layers), step.backward_s / max(1, layers)

    def collective(name: str, nbytes: float, passes: int) -> None:
        for d, group in enumerate(groups):
            done = ring(p, f"{name}.{d}", t, nbytes, passes, [last[node] for node in group], reduced, group,
                        copies=n)
            for node, op in zip(group, done):
                last[node] = (op,)

    def at(module: str, name: str) -> None:   # a split module's f or g, then its adapter's all-reduce
        wide, narrow = (1, 0) if linears is None else linears[module]
        if wide:
            collective(name, activation, 2)
        if narrow:
            collective(f"{name}.lora", adapter, 2)

    def compute(name: str, seconds: float) -> None:
        for node in last:
            last[node] = (p.compute(f"{name}.{node}", node, seconds, last[node]),)

    at("embed", "emb")
    for i in range(layers):
        compute(f"cfa{i}", fwd * ATTENTION)
        at(f"blocks.{i}.attn.proj", f"ga{i}")
        compute(f"cfm{i}", fwd * (1 - ATTENTION))
        at(f"blocks.{i}.mlp.2", f"gm{i}")
    if torch_loss:   # the logits' max, the sum of their exponentials, the target's logit
        for k in range(3):
            collective(f"loss{k}", loss / 2, 2)
    else:
        collective("loss", loss * t, 1)   # an all-gather: each rank's share of t
    for i in reversed(range(layers)):
        compute(f"cbm{i}", bwd * (1 - ATTENTION))
        at(f"blocks.{i}.mlp.0", f"rm{i}")
        compute(f"cba{i}", bwd * ATTENTION)
        at(f"blocks.{i}.attn.qkv", f"ra{i}")
    at("head", "head")
    for k in range(1 if reduced else t):   # each tensor-parallel position's replicas
        on = [0] if reduced else [d * t + k for d in range(dp)]
        done = ring(p, f"dp{k}", dp, grads, 2, [last[node] for node in on], reduced, on, copies=n)
        for node, op in zip(on, done):
            p.compute(f"opt{node}", node, step.optimizer_s, (op,))
    return p
