"""Single-process data parallelism's step as a program (psarch.theory.program): torch.nn.DataParallel's step, which
dp writes out. The master device copies the parameters to each of the N - 1 other devices (replicate: every copy
leaves the master's link at once, sharing it), then every device computes forward and backward of its share of the
batch, and each sends its gradients back to the master (reduce_add), which steps the optimizer. Not modelled: the
inputs scattered and the outputs gathered (the workload's bytes, not the model's), a thread's start."""
from __future__ import annotations

from psarch.theory.program import WORKER, DataStep, Program


def dp_program(n: int, nbytes: float, step: DataStep, reduced: bool = False) -> Program:
    """n devices, the master first, `nbytes` of parameters out to each other device and of gradients back; reduced:
    one node standing for the N - 1 alike devices."""
    p = Program()
    master = p.node(WORKER)
    others = ([p.node(WORKER, n - 1)] if reduced else [p.node(WORKER) for _ in range(n - 1)]) if n > 1 else []
    copies = n - 1 if reduced else 1
    sent = tuple(p.transfer(f"replicate{d}", master, d, nbytes, ("replicate", d), copies=copies) for d in others)
    grads = []
    for d in [master, *others]:
        fwd = p.compute(f"fwd{d}", d, step.forward_s, sent)
        bwd = p.compute(f"bwd{d}", d, step.backward_s, (fwd,))
        grads.append(bwd if d == master else
                     p.transfer(f"reduce{d}", d, master, nbytes, ("reduce", d), (bwd,), copies=copies))
    p.compute("opt", master, step.optimizer_s, tuple(grads))
    return p
