"""A step in steady state: a program played several steps in a row (each node's next step starts once every op of
its step that ends on it is done), for where ranks fall out of step with one another and a step from idle links
is not the steady one (a PS's servers beside workers: the worker beside the last range's server gets it at once,
the others a pull later). The step is the median over the later steps of the mean over nodes of the time from one
step's start to the next's; the first two, filling the links from idle, are not counted (as the PS's flow model
psarch/ps/flows.py, which this replaced, did)."""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import replace

from psarch.theory.program import Cluster, Compute, Program
from psarch.theory.simulate import StepTime, parts, play

STEPS = 8


def repeat(program: Program, steps: int) -> Program:
    """`steps` copies of `program` in a row: copy t's ops named "t|name"; an op that waits for nothing in its step
    waits for every op of the step before that ends on its node (a span of the node, a transfer to it)."""
    on: dict[int, list[str]] = defaultdict(list)
    for op in program.ops:
        on[op.node if isinstance(op, Compute) else op.dst].append(op.name)
    out = Program(nodes=list(program.nodes))
    for t in range(steps):
        for op in program.ops:
            after = tuple(f"{t}|{a}" for a in op.after)
            if not op.after and t:
                node = op.node if isinstance(op, Compute) else op.src
                after = tuple(f"{t - 1}|{a}" for a in on[node])
            out.ops.append(replace(op, name=f"{t}|{op.name}", after=after))
    return out


def steady_step(program: Program, cluster: Cluster, steps: int = STEPS) -> StepTime:
    """The steady step of `program` on `cluster` (steps >= 4: plays of it) and its parts over one counted play, per
    training step (Program.steps)."""
    if steps < 4:
        raise ValueError(f"steady_step: steps = {steps}: at least 4 (the first two are not counted)")
    ops, start, end = play(repeat(program, steps), cluster)
    roots = [op for op in program.ops if not op.after]
    starts: dict[int, list[float]] = defaultdict(list)   # node -> when each step's first ops started
    for t in range(steps):
        first: dict[int, float] = {}
        for op in roots:
            node = op.node if isinstance(op, Compute) else op.src
            first[node] = min(first.get(node, float("inf")), start[f"{t}|{op.name}"])
        for node, at in first.items():
            starts[node].append(at)
    periods = [statistics.mean(s[t + 1] - s[t] for s in starts.values()) for t in range(2, steps - 1)]
    step = statistics.median(periods)
    window = min(starts.values(), key=lambda s: s[steps - 2])   # the last whole step of the first node to start it
    got = parts(ops, start, end, window[steps - 2], window[steps - 1])
    return StepTime(step, got.compute_s, got.exposed_s,
                    max(0.0, step - got.compute_s - got.exposed_s)).per(program.steps)
