"""The pipeline's step as a program (psarch.theory.program), from the facts its engine acts on: each rank's compute
order (schedule.compute_order), the activation each virtual stage receives per micro-batch, and the gradients
each rank all-reduces over its dp replicas.

A rank runs its forwards and backwards in the schedule's order, one at a time; the forward of micro-batch i on
virtual stage j > 0 waits for its activation from stage j - 1, the backward on j < P - 1 for the activation's
gradient from stage j + 1 (each a transfer of the boundary's bytes the moment the op that makes it ends, on one
connection per pair of ranks and direction; isend: the sender goes on computing). Once its last backward is over
and its sends are through, a rank ring all-reduces its gradients with the same stage of the other dp pipelines,
then steps its optimizer. Not modelled: the loss's 8 bytes to each stage.

Full: pipeline d's rank r is node d·p + r. Reduced: every pipeline alike, node r stands for the dp ranks of
stage r, each transfer for dp copies (one per pipeline).
"""
from __future__ import annotations

from collective.pipeline.schedule import FORWARD, Pipe, compute_order
from collective.program import ring
from psarch.theory.program import WORKER, Program


def pipeline_program(schedule: str, pipe: Pipe, dp: int, forward_s: list[float], backward_s: list[float],
                     boundary: list[float], grads: list[float], optimizer_s: float = 0.0,
                     reduced: bool = False) -> Program:
    """`pipe` with `schedule` on dp pipelines: forward_s[j], backward_s[j] the seconds of virtual stage j per
    micro-batch; boundary[j] (j >= 1) the bytes of the activation stage j receives per micro-batch (its gradient
    goes back the same size); grads[r] the gradient bytes of rank r, all-reduced over dp."""
    P = pipe.virtual
    if not (len(forward_s) == len(backward_s) == len(boundary) == P and len(grads) == pipe.p):
        raise ValueError(f"pipeline program: forward_s, backward_s and boundary need one entry per virtual stage "
                         f"({P}), grads one per rank ({pipe.p})")
    p = Program()
    pipelines = 1 if reduced else dp
    for _ in range(pipelines * pipe.p):
        p.node(WORKER, dp if reduced else 1)
    copies = dp if reduced else 1
    lasts: list[list[tuple[str, ...]]] = []
    for d in range(pipelines):
        node = [d * pipe.p + r for r in range(pipe.p)]
        sends: list[list[str]] = [[] for _ in range(pipe.p)]
        last: list[str] = [""] * pipe.p
        for r in range(pipe.p):
            prev: tuple[str, ...] = ()
            for op in compute_order(schedule, pipe, r):
                j = pipe.stage_of(r, op.chunk)
                if op.kind == FORWARD:
                    src = j - 1
                    need = () if j == 0 else (f"a{d}.{j}.{op.mb}",) if pipe.place(src)[0] != r else \
                        (f"f{d}.{src}.{op.mb}",)
                    name = p.compute(f"f{d}.{j}.{op.mb}", node[r], forward_s[j], prev + need)
                else:
                    src = j + 1
                    need = (f"f{d}.{j}.{op.mb}",) if j == P - 1 else (f"g{d}.{j}.{op.mb}",) \
                        if pipe.place(src)[0] != r else (f"b{d}.{src}.{op.mb}",)
                    name = p.compute(f"b{d}.{j}.{op.mb}", node[r], backward_s[j], prev + need)
                prev = (name,)
            last[r] = prev[0]
        for r in range(pipe.p):
            for op in compute_order(schedule, pipe, r):
                j = pipe.stage_of(r, op.chunk)
                to = j + 1 if op.kind == FORWARD else j - 1
                if not 0 <= to < P or pipe.place(to)[0] == r:
                    continue
                dst = pipe.place(to)[0]
                if op.kind == FORWARD:
                    name = p.transfer(f"a{d}.{to}.{op.mb}", node[r], node[dst], boundary[to], ("act", node[r], node[dst]),
                                      (f"f{d}.{j}.{op.mb}",), copies=copies)
                else:
                    name = p.transfer(f"g{d}.{to}.{op.mb}", node[r], node[dst], boundary[j], ("grad", node[r], node[dst]),
                                      (f"b{d}.{j}.{op.mb}",), copies=copies)
                sends[r].append(name)
        lasts.append([(last[r], *sends[r]) for r in range(pipe.p)])
    for r in range(pipe.p):
        on = [d * pipe.p + r for d in range(pipelines)]
        done = ring(p, f"ar{r}", dp, grads[r], 2, [lasts[d][r] for d in range(pipelines)], reduced, on)
        for d, n in enumerate(on):
            p.compute(f"opt{n}", n, optimizer_s, (done[d],))
    return p


def stage_seconds(pipe: Pipe, forward_s: float, backward_s: float, stage_params: list[float]) -> tuple[list[float],
                                                                                                      list[float]]:
    """Each virtual stage's forward and backward seconds per micro-batch: a pipeline's whole forward and backward
    shared among its stages by their parameters, and by the m micro-batches."""
    total = sum(stage_params) or 1.0
    return ([forward_s * s / total / pipe.m for s in stage_params], [backward_s * s / total / pipe.m
                                                                      for s in stage_params])
