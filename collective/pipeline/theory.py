"""What theory predicts for a pipeline-parallel run, rank by rank (the stages differ).

- Idle fraction (the bubble): (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/p for the
  naive schedule (schedule.bubble_fraction; schedule.simulate counts the same from the instructions).
- Bytes per step: each micro-batch crosses every stage boundary once each way, its activation forward and
  the activation's gradient backward: b·s·h values of the compute dtype for a GPT (the boundary's shape,
  from a trace of the model on the meta device). A rank's boundaries are those of its chunks. With data
  parallelism (dp = world_size / p), each stage's gradients are ring all-reduced over its dp ranks
  (2(dp-1)/dp of its own gradients, collective/comm.ring_bytes), and the last stage shares the loss: a ring
  all-reduce of one fp64 over its dp group, then 8 bytes to each other stage of its pipeline.
- Memory: parameters, gradients and optimizer state of the rank's own units (about 1/p of the model's),
  counted from the cut of the model itself; activations held for backward: the schedule's most micro-batch
  chunks in flight on the rank (GPipe m, 1F1B p - s at stage s) times what each keeps
  (psarch.activations.block_activation_bytes per GPT block, and the embedding's and the head's own).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from collective.comm import ring_bytes
from collective.pipeline.schedule import BACKWARD, FORWARD, Pipe, bubble_fraction, compute_order
from collective.pipeline.stage import Cut
from psarch.config.backend import units_attr
from psarch.activations import block_activation_bytes
from psarch.backend import EstimateRow
from psarch.theory import (BYTES, LinkBytes, MemoryPrediction, NodePrediction, Prediction,
                           optimizer_bytes_per_param)

if TYPE_CHECKING:
    from psarch.config import Config
LOSS_BYTES = 8   # the step's loss travels as one fp64


def pipe_of(cfg: Config) -> Pipe:
    """The run's pipeline shape (v = 1 but for the interleaved schedule)."""
    b = cfg.backend
    return Pipe(b.pipeline_stages, b.microbatches, b.virtual_stages if b.schedule == "interleaved" else 1)


def data_parallel(cfg: Config) -> int:
    """dp: how many pipelines train side by side (world_size = dp x stages)."""
    return cfg.backend.world_size // cfg.backend.pipeline_stages


def micro_batch_size(cfg: Config) -> int:
    """b: sequences per micro-batch."""
    return cfg.train.global_batch // (data_parallel(cfg) * cfg.backend.microbatches)


@dataclass
class Layout:
    """The cut of the config's model: elements of each virtual stage's parameters, and of the activation each
    receives per micro-batch (index 0 unused: the first stage reads the data); `stage_frozen`: each virtual
    stage's frozen parameters (train.trainable, LoRA's base weights), which only that stage keeps."""

    stage_params: list[int]
    boundary: list[int]
    blocks: list[int]
    stage_frozen: list[int] | None = None


def layout(cfg: Config) -> Layout:
    """The cut, made on the meta device (no memory) from one micro-batch of step 0's data."""
    from psarch.workload import build_workload

    pipe = pipe_of(cfg)
    workload = build_workload(cfg, device="meta")
    local = workload.batch(0, 0, data_parallel(cfg))
    mb = _to_meta(_first_micro_batch(local, pipe.m))
    cut = Cut(workload.model, units_attr(cfg.backend), workload.loss_fn, mb, pipe.virtual, [])
    boundary = [0] + [torch.Size(cut.input_shape(j)[0]).numel() for j in range(1, pipe.virtual)]
    return Layout(cut.stage_params(), boundary, [len(r) for r in cut.ranges], cut.stage_params(trainable=False))


def gpt_layout(cfg: Config) -> Layout | None:
    """The cut of the config's built-in GPT from its shape alone (no data, no trace: what `layout` finds, fast at
    any size): the embeddings on the first stage, the blocks split as split_blocks does, the final norm and the
    head on the last; b·s·h values cross each boundary. None for other models (or frozen parameters)."""
    from collective.pipeline.stage import split_blocks
    from collective.tensor.theory import gpt_shapes

    w = cfg.workload
    if w.factory or w.model != "gpt" or units_attr(cfg.backend) != "blocks" or cfg.train.trainable or cfg.train.lora_rank:
        return None
    P = pipe_of(cfg).virtual
    ranges = split_blocks(w.gpt.n_layer, P)
    params = [0] * P
    for name, shape in gpt_shapes(cfg).items():
        n = math.prod(shape)
        if name.startswith("blocks."):
            i = int(name.split(".")[1])
            params[next(j for j, r in enumerate(ranges) if i in r)] += n
        else:
            params[0 if name.startswith(("embed.", "pos.")) or P == 1 else P - 1] += n
    boundary = [0] + [micro_batch_size(cfg) * w.seq_len * w.gpt.n_embd] * (P - 1)
    return Layout(params, boundary, [len(r) for r in ranges], [0] * P)   # nothing frozen (else None above)


def _first_micro_batch(batch: Any, m: int) -> Any:
    if torch.is_tensor(batch):
        return batch[:batch.shape[0] // m]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_first_micro_batch(b, m) for b in batch)
    return {k: _first_micro_batch(v, m) for k, v in batch.items()} if isinstance(batch, dict) else batch


def _to_meta(batch: Any) -> Any:
    if torch.is_tensor(batch):
        return batch.to("meta")
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_meta(b) for b in batch)
    return {k: _to_meta(v) for k, v in batch.items()} if isinstance(batch, dict) else batch


def stage_activation_bytes(cfg: Config, stage: int, blocks: int) -> float | None:
    """Bytes virtual stage `stage` keeps for backward per micro-batch: its GPT blocks, plus the embedding's
    indices on the first stage and the final norm, head and loss on the last; None for other models."""
    w = cfg.workload
    if w.factory or w.model != "gpt":
        return None
    s, b, h, a, width = w.seq_len, micro_batch_size(cfg), w.gpt.n_embd, w.gpt.n_head, BYTES[cfg.train.precision]
    total = blocks * block_activation_bytes(s, b, h, a, width)
    if stage == 0:   # the micro-batch's tokens (b x (s+1), int64) and the positions (s) the embeddings index by
        total += 8 * b * (s + 1) + 8 * s
    if stage == pipe_of(cfg).virtual - 1:
        # the final norm's input and statistics, the head's input, log_softmax's fp32 output over the
        # vocabulary, the targets (int64), and nll_loss's total weight (one fp32)
        vocab = w.markov.vocab_size if w.data == "markov" else 256
        total += s * b * (2 * h * width + 2 * width + 4 * vocab + 8) + 4
    return total


def held_peak(order: list, per_chunk: list[float]) -> float:
    """Most bytes of activations a rank holds at once running `order`, chunk c's forward keeping per_chunk[c]
    until its backward."""
    held = peak = 0.0
    for op in order:
        held += per_chunk[op.chunk] if op.kind == FORWARD else -per_chunk[op.chunk] if op.kind == BACKWARD else 0
        peak = max(peak, held)
    return peak


def boundaries(pipe: Pipe, rank: int) -> list[int]:
    """The stage boundaries rank `rank` sits at, each named by the virtual stage after it."""
    out = []
    for c in range(pipe.v):
        j = pipe.stage_of(rank, c)
        out += ([j] if j > 0 else []) + ([j + 1] if j < pipe.virtual - 1 else [])
    return out


def link_bytes(cfg: Config, lay: Layout, rank: int) -> LinkBytes:
    """Bytes rank `rank` sends and receives per step: activations and their gradients at its chunks'
    boundaries, its stage's gradient all-reduce over dp, and the loss."""
    pipe, dp, width = pipe_of(cfg), data_parallel(cfg), BYTES[cfg.train.precision]
    sent = received = 0.0
    for boundary in boundaries(pipe, rank):
        volume = pipe.m * lay.boundary[boundary] * width
        sent, received = sent + volume, received + volume   # activation one way, its gradient the other
    own = sum(lay.stage_params[pipe.stage_of(rank, c)] for c in range(pipe.v))
    s, r = ring_bytes("all_reduce", own, width, dp)
    sent, received = sent + s, received + r
    if rank == pipe.p - 1:
        s, r = ring_bytes("all_reduce", 1, LOSS_BYTES, dp)
        sent, received = sent + s + LOSS_BYTES * (pipe.p - 1), received + r
    else:
        received += LOSS_BYTES
    return LinkBytes(sent, received)


def predict(cfg: Config, phi: float) -> Prediction:
    """Every stage's memory, link bytes, idle fraction and activations held: a role per stage ("stage 0", ...),
    each standing for its dp ranks."""
    pipe, t, dp = pipe_of(cfg), cfg.train, data_parallel(cfg)
    lay = gpt_layout(cfg) or layout(cfg)
    width, k = BYTES[t.precision], optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
    blocks = lay.blocks
    stages: dict[str, NodePrediction] = {}
    for r in range(pipe.p):
        own = sum(lay.stage_params[pipe.stage_of(r, c)] for c in range(pipe.v))
        frozen = sum((lay.stage_frozen or [0] * pipe.virtual)[pipe.stage_of(r, c)] for c in range(pipe.v))
        figures = {"stage": r, "stage_params": own,
                   "idle_fraction": float(bubble_fraction(cfg.backend.schedule, pipe))}
        per_chunk = [stage_activation_bytes(cfg, pipe.stage_of(r, c), blocks[pipe.stage_of(r, c)])
                     for c in range(pipe.v)]
        known = [b for b in per_chunk if b is not None]
        if len(known) == len(per_chunk):
            figures["activations_held"] = held_peak(compute_order(cfg.backend.schedule, pipe, r), known)
        memory = MemoryPrediction(width * own, width * own, k * own, frozen=width * frozen)
        ranks = range(r, pipe.p * dp, pipe.p)   # rank = dp_rank x p + stage
        stages[f"stage {r}"] = NodePrediction(memory, link_bytes(cfg, lay, r), figures, ranks=ranks)
    # phases per step: activations forward and gradients backward along the pipeline, then the ring's two
    # passes; messages: the busiest rank's transfers (one per micro-batch, boundary and direction) and the ring's
    transfers = max(2 * pipe.m * len(boundaries(pipe, r)) for r in range(pipe.p))
    ring = 2 * (dp - 1) if dp > 1 else 0
    return Prediction(stages, rounds=2 + (2 if dp > 1 else 0), messages=transfers + ring)


def size_estimate(phi: float, world: int, p: int, m: int, precision: str, optimizer: str) -> list[EstimateRow]:
    """`psarch estimate`'s pipeline rows from Φ alone: p stages of Φ/p each (blocks dominate a deep model),
    dp = world / p replicas whose gradients are ring all-reduced, and each schedule's bubble. The activations
    crossing a boundary (b·s·h per micro-batch each way) need the model's shape: a run's summary has them."""
    if p < 1 or world % p:
        return []
    dp, width = world // p, BYTES[precision]
    own = phi / p
    states = (2 * width + optimizer_bytes_per_param(optimizer, precision)) * own
    sent = 2 * (dp - 1) / dp * own * width
    rows: list[EstimateRow] = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        if schedule == "interleaved" and m % p:
            continue
        rows.append({"label": f"pipeline {schedule} p={p} m={m}" + (f" v={v}" if v > 1 else "") + f" dp={dp}",
                     "states": states, "sent": sent, "bubble": float(bubble_fraction(schedule, Pipe(p, m, v)))})
    return rows


def program(cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
    """The run's step program (collective/pipeline/program.py) from its cut: `step` what one rank computes, the
    pipeline's p of them shared among its virtual stages by their parameters; each boundary's activation; each
    rank's gradients (the stages' parameters scaled to Φ = phi)."""
    from collective.pipeline.program import pipeline_program, stage_seconds

    pipe, width = pipe_of(cfg), BYTES[cfg.train.precision]
    lay = gpt_layout(cfg) or layout(cfg)
    scale = phi / (sum(lay.stage_params) or 1)
    params = [x * scale for x in lay.stage_params]
    # compute follows every weight a stage multiplies by, frozen ones too
    weights = [float(x + f) for x, f in zip(lay.stage_params, lay.stage_frozen or [0] * len(lay.stage_params))]
    fwd, bwd = stage_seconds(pipe, step.forward_s * pipe.p, step.backward_s * pipe.p, weights)
    grads = [width * sum(params[pipe.stage_of(r, c)] for c in range(pipe.v)) for r in range(pipe.p)]
    return pipeline_program(cfg.backend.schedule, pipe, data_parallel(cfg), fwd, bwd,
                            [width * x for x in lay.boundary], grads, step.optimizer_s, reduced)
