"""`psarch estimate --tensor-parallel t`: what tensor parallelism (Megatron) costs a GPT of a given shape at each
degree t dividing the world, data parallelism over the rest: model states, the blocks' activations and bytes
sent per device per step, from the tensor backend's own theory (its spec's predict)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from psarch import theory
from psarch.config import Config, from_dict
from psarch.workload import theory_model


@dataclass(frozen=True)
class GPTShape:
    """A GPT as psarch builds it: blocks, width, heads, tokens per sequence, sequences per data-parallel replica
    per step, vocabulary."""

    layers: int = 24
    hidden: int = 2048
    heads: int = 16
    seq: int = 2048
    micro_batch: int = 8
    vocab: int = 50257

    def params(self) -> int:
        """Φ: the parameters of the GPT the config's workload builds (psarch.workload.theory_model, built once)."""
        return sum(p.numel() for p in theory_model(from_dict({"workload": self.workload()})).parameters())

    def workload(self) -> dict:
        """The config's [workload] section of this GPT (on Markov data of its vocabulary)."""
        return {"model": "gpt", "data": "markov", "seq_len": self.seq, "markov": {"vocab_size": self.vocab},
                "gpt": {"n_layer": self.layers, "n_embd": self.hidden, "n_head": self.heads}}


# GPT-3's widths and heads by size (Brown et al. 2020, Table 2.1), heads of 128 from 1.3B on (the table's 24 heads
# do not divide 1.3B's 2,048, nor 40 heads 13B's 5,140: read as 5,120)
GPT3_WIDTHS = ((125e6, 768, 12), (350e6, 1024, 16), (760e6, 1536, 16), (1.3e9, 2048, 16), (2.7e9, 2560, 32),
               (6.7e9, 4096, 32), (13e9, 5120, 40), (175e9, 12288, 96))


def standard_shape(phi: float) -> GPTShape:
    """A GPT of about Φ = phi parameters for a Φ asked about alone: the width and heads of GPT-3's size nearest Φ
    (GPT3_WIDTHS), as many blocks as bring it nearest Φ (at least one), the default sequence and vocabulary."""
    _, hidden, heads = min(GPT3_WIDTHS, key=lambda row: abs(math.log(phi / row[0])))
    one, two = (GPTShape(k, hidden, heads).params() for k in (1, 2))
    block = two - one
    root = one - block
    return GPTShape(max(1, round((phi - root) / block)), hidden, heads)


def tensor_config(shape: GPTShape, t: int, world: int, precision: str, optimizer: str) -> Config:
    """A `tensor` run of this shape: t-way tensor parallelism, world / t replicas of micro_batch sequences each."""
    return from_dict({"workload": shape.workload(),
                      "train": {"precision": precision, "optimizer": optimizer,
                                "global_batch": shape.micro_batch * world // t},
                      "backend": {"kind": "tensor", "world_size": world, "tensor_parallel": t}})


def degrees(shape: GPTShape, world: int) -> list[int]:
    """Powers of two that divide the world size and the heads."""
    return [2**k for k in range(int(math.log2(world)) + 1) if world % 2**k == 0 and shape.heads % 2**k == 0]


def tensor_rows(shape: GPTShape, world: int, precision: str, optimizer: str) -> list[dict]:
    """Per degree t: model-state bytes, blocks' activation bytes and bytes sent per device per step."""
    phi = shape.params()
    rows = []
    for t in degrees(shape, world):
        p = theory.predict(tensor_config(shape, t, world, precision, optimizer), phi)
        assert p.per_rank is not None, "the tensor backend predicts each rank (Prediction.per_rank)"
        rows.append({"t": t, "replicas": world // t, "states": p.memory_per_rank.total,
                     "activations": p.per_rank[0].figures["block_activation_bytes"], "sent": p.link.sent})
    return rows


def tensor_report(shape: GPTShape, world: int, chosen: int, precision: str, optimizer: str) -> list[str]:
    """The lines `psarch estimate --tensor-parallel` prints."""
    head = (f"== tensor parallelism (Megatron) at N = {world}: GPT {shape.layers} x {shape.hidden}, {shape.heads} "
            f"heads, {shape.seq} tokens x {shape.micro_batch} sequences per replica, vocabulary {shape.vocab} "
            f"(Φ = {shape.params() / 1e9:.3g}B), {precision} + {optimizer}, GB per device")
    out = [head, f"{'t':>5} {'dp':>6} {'model states':>13} {'activations':>12} {'sent/step':>10}"]
    for r in tensor_rows(shape, world, precision, optimizer):
        mark = "  <- --tensor-parallel" if r["t"] == chosen else ""
        out.append(f"{r['t']:>5} {r['replicas']:>6} {r['states'] / 1e9:>13.3g} {r['activations'] / 1e9:>12.3g} "
                   f"{r['sent'] / 1e9:>10.3g}{mark}")
    return out
