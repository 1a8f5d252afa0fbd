"""One rank's part of a pipeline step: its instruction list (schedule.instructions) run in order.

Activations and gradients arrive by point-to-point receives posted a few instructions ahead, so a transfer
overlaps the compute before it; sends are waited on at the end of the step. Each forward runs the workload's
loss_fn on the micro-batch with the model switched to the virtual stage (stage.Cut): its output (or, on the
last stage, the loss) is kept with the received input until the backward, which sends the input's gradient
back. The clock separates compute (forwards and backwards) from everything else: the idle fraction of the
step's pipeline phase is 1 - compute / phase.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from collective.pipeline.p2p import P2P, Transfer, tag
from collective.pipeline.schedule import (BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, Op, Pipe,
                                          peer)
from collective.pipeline.stage import Cut, StageOutput
from psarch.meters import SavedActivationMeter

RECEIVES_AHEAD = 2   # receives posted before the instruction that needs them


@dataclass
class Outcome:
    """What a step's pipeline phase produced on this rank."""

    losses: list[torch.Tensor] = field(default_factory=list)   # the last stage's, one per micro-batch
    compute_s: float = 0.0       # forwards and backwards
    phase_s: float = 0.0         # the whole instruction list, waits included
    waited_s: float = 0.0        # blocked on receives and sends
    activations_peak: int | None = None   # bytes kept for backward, most at once (when measured)

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.compute_s / self.phase_s if self.phase_s > 0 else 0.0


class Engine:
    """Runs the instruction list `program` of stage `rank` of a pipeline whose stage s is global rank
    `first_rank` + s."""

    def __init__(self, cut: Cut, p2p: P2P, pipe: Pipe, rank: int, first_rank: int, program: list[Op],
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], scale_loss: Callable,
                 exclude: Callable[[], set[int]]) -> None:
        self.cut, self.p2p, self.pipe, self.rank, self.program = cut, p2p, pipe, rank, program
        self.first_rank = first_rank
        self.loss_fn, self.scale_loss, self.exclude = loss_fn, scale_loss, exclude
        self.last = pipe.virtual - 1
        self.waited_total = 0.0  # seconds blocked on transfers so far (Trainer.comm_waited_s)

    def _peer(self, op: Op) -> int:
        return self.first_rank + peer(self.pipe, self.rank, op)

    def _recv(self, op: Op) -> Transfer:
        j = self.pipe.stage_of(self.rank, op.chunk)
        kind = "activation" if op.kind == RECV_ACT else "gradient"
        shape, dtype = self.cut.input_shape(j if op.kind == RECV_ACT else j + 1)
        return self.p2p.recv(shape, dtype, self.cut.device, self._peer(op), kind,
                             tag(kind, op.mb, j if op.kind == RECV_ACT else j + 1, self.pipe.m))

    def run(self, micro_batches: list[Any], measure: bool = False) -> Outcome:
        """Run the step's instructions; `measure`: count the activations kept for backward."""
        step = _Step(self, micro_batches, measure)
        t_start = time.perf_counter()
        for op in self.program:
            step.post_receives()
            step.handlers[op.kind](op, (op.mb, op.chunk), self.pipe.stage_of(self.rank, op.chunk))
        out = step.out
        t0 = time.perf_counter()
        for s in step.sends:
            s.wait()
        out.waited_s += time.perf_counter() - t0
        out.phase_s = time.perf_counter() - t_start
        self.waited_total += out.waited_s
        out.activations_peak = step.peak if measure else None
        return out

    def _forward(self, stage: int, x: torch.Tensor | None, batch: Any, measure: bool) -> tuple[torch.Tensor, int]:
        """Virtual stage `stage` on one micro-batch: its output (the loss on the last stage) and the bytes it
        keeps for backward (0 unless measured)."""
        meter = SavedActivationMeter(self.exclude) if measure else None
        with self.cut.running(stage, x):
            if meter is not None:
                meter.__enter__()
            try:
                y = self.loss_fn(self.cut.model, batch)
            except StageOutput as e:
                y = e.output
            finally:
                if meter is not None:
                    meter.__exit__(None, None, None)
        return y, meter.bytes if meter is not None else 0


class _Step:
    """One step's state on a rank: transfers posted, activations and gradients held; a handler per instruction
    kind, each given the instruction, its (micro-batch, chunk) and its virtual stage."""

    def __init__(self, engine: Engine, micro_batches: list[Any], measure: bool) -> None:
        self.e, self.micro_batches, self.measure = engine, micro_batches, measure
        self.out = Outcome()
        self.receives = deque(op for op in engine.program if op.kind in (RECV_ACT, RECV_GRAD))
        self.posted: dict[Op, Transfer] = {}
        # (mb, chunk) -> (received input or None, output or loss, bytes kept for backward)
        self.held: dict[tuple[int, int], tuple[Any, Any, int]] = {}
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.sends: list[Transfer] = []
        self.live = self.peak = 0
        self.handlers = {RECV_ACT: self.receive, RECV_GRAD: self.receive, FORWARD: self.forward,
                         SEND_ACT: self.send_activation, BACKWARD: self.backward, SEND_GRAD: self.send_gradient}

    def post_receives(self) -> None:
        while self.receives and len(self.posted) < RECEIVES_AHEAD:
            op = self.receives.popleft()
            self.posted[op] = self.e._recv(op)

    def receive(self, op: Op, key: tuple[int, int], j: int) -> None:
        t0 = time.perf_counter()
        got = self.posted.pop(op).wait()
        self.out.waited_s += time.perf_counter() - t0
        if op.kind == RECV_ACT:
            self.held[key] = (got.requires_grad_(), None, 0)
        else:
            self.grads[key] = got

    def forward(self, op: Op, key: tuple[int, int], j: int) -> None:
        t0 = time.perf_counter()
        x = self.held.pop(key, (None, None, 0))[0]
        y, nbytes = self.e._forward(j, x, self.micro_batches[op.mb], self.measure)
        self.out.compute_s += time.perf_counter() - t0
        self.held[key] = (x, y, nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        if j == self.e.last:
            self.out.losses.append(y.detach())

    def send_activation(self, op: Op, key: tuple[int, int], j: int) -> None:
        self.sends.append(self.e.p2p.send(self.held[key][1], self.e._peer(op), "activation",
                                          tag("activation", op.mb, j + 1, self.e.pipe.m)))

    def backward(self, op: Op, key: tuple[int, int], j: int) -> None:
        t0 = time.perf_counter()
        _, y, nbytes = self.held[key] if j > 0 else self.held.pop(key)   # stage > 0: its input's gradient goes back
        if j == self.e.last:
            self.e.scale_loss(y / self.e.pipe.m).backward()
        else:
            torch.autograd.backward(y, self.grads.pop(key))
        self.out.compute_s += time.perf_counter() - t0
        self.live -= nbytes

    def send_gradient(self, op: Op, key: tuple[int, int], j: int) -> None:
        x = self.held.pop(key)[0]
        self.sends.append(self.e.p2p.send(x.grad, self.e._peer(op), "gradient",
                                          tag("gradient", op.mb, j, self.e.pipe.m)))
