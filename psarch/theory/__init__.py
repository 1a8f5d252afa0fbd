"""What theory predicts for a run: `predict(cfg, phi)`, answered by the backend's own theory (its spec's
`predict`: collective/theory.py, zero/theory.py, psarch/ps/theory.py), as a Prediction of the nodes it names by
role (the core asks which rank is the fullest or the busiest, never which role is which), and the algebra they
share here (the records, Prediction and its nodes, in prediction.py):
memory per rank by category (the ZeRO paper's Table 1 cells, Rajbhandari et al. 2020), ring passes,
expected distinct embedding rows, and an emulated run's step time (`cluster_step`: the step simulator's where
the backend writes its step as a program). Every output beside a
measured figure (psarch.launch.outputs, psarch.report.compare, the estimator) calls `predict`; nothing patches
its result afterwards. Beside it in this package: the step simulator, `program.py` (a step as a program: compute
spans, transfers, the cluster), `simulate.py` (one program played) and `steady.py` (several steps in a row);
`estimate.py`, the estimator of `psarch estimate` (memory, traffic from Φ alone; `estimate_steps.py` its step
times through the simulator, 1 to 1,024 workers; `estimate_tensor.py` its tensor-parallel rows), and `cli.py`,
the command.
"""
from __future__ import annotations

import math
from typing import Any

from psarch import registry
from psarch.config import Config, from_dict
from psarch.records import Summary
from psarch.theory.prediction import (BYTES, LinkBytes, MemoryPrediction, NodePrediction,  # noqa: F401
                                      Prediction, optimizer_bytes_per_param)
from psarch.zipf import expected_unique


def predict(cfg: Config, phi: float, frozen: float = 0.0) -> Prediction:
    """What theory predicts for `cfg` with `phi` parameters that train: the backend's own theory
    (BackendSpec.predict). S = phi x the wire dtype's bytes (the compute precision), N = backend.world_size.
    `frozen` parameters hold no gradient or optimizer state and are reduced nowhere: each copy the backend keeps of
    the model (BackendSpec.frozen_copies) holds them whole in the compute dtype on each rank's node, unless the
    backend's theory placed them itself: in its ranks' memory (a sharding backend: each rank its shard, all-gathered
    where it says) or rank by rank (rank_by_rank: a pipeline's stages each keep their own, a tensor rank its parts; a
    stage with none keeps none, never written here). Serving nodes hold none."""
    spec = registry.spec_of(cfg)
    p = spec.predict(cfg, phi)
    if not p.rank_by_rank and not p.memory_per_rank.frozen:
        for node in p.trainers.values():
            node.memory.frozen = frozen * BYTES[cfg.train.precision] * spec.frozen_copies(cfg)
    return p


# ---------------------------------------------------------------- shared algebra

def sharded_memory(cfg: Config, phi: float, stage: int) -> MemoryPrediction:
    """Model states per rank with ZeRO stage `stage` over backend.world_size ranks (stage 0: replicated, as
    DDP): parameters, gradients, optimizer state (K bytes per parameter) each 1/N from their stage on."""
    t, n = cfg.train, cfg.backend.world_size
    width, k = BYTES[t.precision], optimizer_bytes_per_param(t.optimizer, t.precision, t.momentum)
    return MemoryPrediction(params=width * phi / n if stage >= 3 else width * phi,
                            grads=width * phi / n if stage >= 2 else width * phi,
                            optimizer=k * phi / n if stage >= 1 else k * phi)


def ring_passes(mem: MemoryPrediction, cfg: Config, phi: float, passes: int) -> Prediction:
    """`passes` ring passes over S = phi x width per step: each is N - 1 messages of S/N each way, so
    (N - 1)/N x S per pass per worker."""
    n, s = cfg.backend.world_size, phi * BYTES[cfg.train.precision]
    if n == 1 or passes == 0:
        return Prediction.alike(mem, LinkBytes(), n, rounds=0, messages=0)
    v = passes * (n - 1) / n * s
    return Prediction.alike(mem, LinkBytes(v, v), n, rounds=passes, messages=passes * (n - 1))


def expected_unique_ids(cfg: Config, steps: int = 1) -> float:
    """E[u], the distinct rows one worker's batches of `steps` steps read, over all tables (clicks data's
    Zipf law; draws = steps x local batch x bag per table)."""
    d = cfg.workload.dlrm
    draws = steps * cfg.train.global_batch // cfg.backend.world_size * d.bag
    return d.num_tables * expected_unique(d.rows, cfg.workload.clicks.zipf, draws)


def table_params(cfg: Config) -> int:
    """Parameters in the dlrm model's embedding tables ([workload.dlrm])."""
    d = cfg.workload.dlrm
    return d.num_tables * d.rows * d.dim


def config_for(kind: str, n: int, precision: str = "fp32", optimizer: str = "adamw", momentum: float = 0.0,
               workload: dict | None = None, per_rank: int = 1, **backend: Any) -> Config:
    """A config holding only what `predict` reads: for tables over kinds and world sizes (estimate,
    benchmarks); `backend`: that backend's options (stage, mode, servers, ...); `workload`: its [workload] section
    (the model whose units ZeRO-3 gathers; default the default config's); `per_rank`: samples per rank a step (the
    rows a rank touches where tables are on servers)."""
    return from_dict({**({"workload": workload} if workload else {}),
                      "train": {"precision": precision, "optimizer": optimizer, "momentum": momentum,
                                "global_batch": n * per_rank},
                      "backend": {"kind": kind, "world_size": n, **backend}})


def memory_per_rank(kind: str, phi: float, n: int, precision: str = "fp32", optimizer: str = "adamw",
                    momentum: float = 0.0, **backend: Any) -> MemoryPrediction:
    """`predict(...).memory_per_rank` by kind (benchmarks and tables)."""
    return predict(config_for(kind, n, precision, optimizer, momentum, **backend), phi).memory_per_rank


def traffic_per_step(kind: str, payload_bytes: float, n: int, **backend: Any) -> dict[str, float]:
    """`predict(...)`'s traffic for an fp32 run whose payload S is `payload_bytes` (benchmarks and tables)."""
    p = predict(config_for(kind, n, **backend), payload_bytes / BYTES["fp32"])
    return p.to_dict()["traffic_per_step"]


# ---------------------------------------------------------------- step time on a cluster

# Bytes on an Ethernet link per byte of TCP payload: a 1500-byte MTU frame (1514 B with its Ethernet
# header, as tbf counts it) carries 1448 B of payload after the IP and TCP (with timestamps) headers.
WIRE_OVERHEAD = 1514 / 1448


def topk_k(numel: int, ratio: float) -> int:
    """Elements top-k (train.compression) sends of a bucket or partition of `numel`: ceil(ratio x numel), at
    least one."""
    return max(1, math.ceil(ratio * numel))


def cluster_step(cfg: Config, summary: Summary) -> dict[str, float]:
    """Measured | predicted step time of a finished run on the emulated cluster. Compute is a virtual device's modelled
    forward and backward (summary's virtual_device: cluster time, α / D, nothing of the communication inside it), else
    the measured step less its communication wait; where that holds waits too (BackendSpec.compute_holds_waits: ZeRO-3,
    torch_pipeline, torch_tensor, torch_fsdp) the compute that, played with the program, ends when it does
    (pure_compute). For those backends only what follows the last compute span is predicted: the waits inside the
    compute are taken from the measurement, not predicted. The step simulator plays the backend's step program
    (BackendSpec.program) on the run's links (psarch.theory.simulate); nan where it writes none (a backend that declares
    no program), and where the trainer timed no wait apart from a measured compute that holds them (torch_fsdp,
    torch_tensor on contended cores): the compute taken from such a step would make the step predicted equal the step
    measured, by construction, which predicts nothing."""
    from psarch.cluster.device import as_paced

    cfg = as_paced(cfg, summary.get("virtual_device"))   # this core's rate, where the run measured it
    spec = registry.spec_of(cfg)
    phi = summary["params"]
    compute, backward, alpha = step_inputs(summary)
    out = {"measured_s": summary["step_time_s"], "compute_s": compute}
    if backward is None and spec.compute_holds_waits(cfg):
        if not summary.get("comm_s"):   # a trainer that times no wait measured the whole step: nothing to predict
            return out | {"predicted_s": math.nan, "predicted_comm_s": math.nan}
        compute = pure_compute(cfg, phi, compute, alpha)
    step = simulated_step(cfg, phi, compute, backward, alpha)
    if step is None:
        return out | {"predicted_s": math.nan, "predicted_comm_s": math.nan}
    return out | {"predicted_s": step.step_s, "predicted_comm_s": step.step_s - compute}


def pure_compute(cfg: Config, phi: float, measured_s: float, alpha_s: float, tolerance: float = 1e-4) -> float:
    """The compute per step, communication apart, of a run whose measured compute `measured_s` holds the waits of
    collectives that block inside forward and backward (ZeRO-3, torch_pipeline, ...: BackendSpec.compute_holds_waits):
    the compute c for which the program (played once from idle links) ends its last compute span at measured_s, c
    taken from measured_s by the time by which it falls short (each wait is about independent of c: a few rounds).
    So the waits up to the last compute span come from the measurement, and only what follows it is predicted.
    measured_s itself where the backend writes no program."""
    from psarch.theory.program import Compute
    from psarch.theory.simulate import play

    c = measured_s
    for _ in range(20):
        got = program_on_links(cfg, phi, c, None, alpha_s)
        if got is None:
            return measured_s
        ops, _, end = play(*got)
        last = max((end[n] for n, op in ops.items() if isinstance(op, Compute) and op.seconds > 0), default=0.0)
        if abs(last - measured_s) <= tolerance * measured_s or c == 0.0:
            break
        c = max(0.0, c - (last - measured_s))
    return c


def step_inputs(summary: Summary) -> tuple[float, float | None, float]:
    """What a finished run's step is predicted from: compute per step, its backward (None: unknown) and α, in the
    cluster's time. A virtual device's modelled forward and backward (α / D), else the measured step less its
    communication wait (the run's emulated α; 0 on loopback)."""
    vd, alpha = summary.get("virtual_device"), (summary.get("cluster") or {}).get("alpha_s", 0.0)
    modelled = vd.get("compute_s") if vd is not None else None
    if vd is not None and modelled is not None:
        return modelled, modelled * vd["backward_s"] / (vd["forward_s"] + vd["backward_s"]), alpha / vd["dilation"]
    return summary["step_time_s"] - (summary.get("comm_s") or 0.0), None, alpha


def simulated_step(cfg: Config, phi: float, compute_s: float, backward_s: float | None, alpha_s: float) -> Any:
    """The step simulator's steady step (psarch.theory.steady: StepTime) of `cfg`'s program in full on its
    emulated links (payload rates, WIRE_OVERHEAD counted); None where the backend writes no program."""
    from psarch.theory.steady import steady_step

    got = program_on_links(cfg, phi, compute_s, backward_s, alpha_s)
    return None if got is None else steady_step(*got)


def world_step(cfg: Config, summary: Summary, n: int) -> float | None:
    """The step simulator's steady step of `cfg`'s program at backend.world_size = n, the global batch kept: a
    rank's compute goes as its shard, 1 / n of the batch. The compute it scales: a virtual device's modelled forward
    and backward at cfg's world size where the run has one, else the first world's median step at its size
    (summary's worlds[0], measured before any failure; its communication counted as compute, an upper bound). What
    a world restarted at another size (faults.restart = "shrink") is predicted with (psarch.launch.failure_cost);
    None where the backend writes no program or nothing measured a step."""
    import dataclasses

    from psarch.cluster.device import as_paced

    vd, worlds = summary.get("virtual_device"), summary.get("worlds") or []
    cfg = as_paced(cfg, vd)
    if vd is not None and vd.get("compute_s") is not None:
        (compute, backward, alpha), at = step_inputs(summary), cfg.backend.world_size
    elif worlds and worlds[0].get("step_time_s"):
        compute, backward, alpha = worlds[0]["step_time_s"], None, (summary.get("cluster") or {}).get("alpha_s", 0.0)
        at = worlds[0]["world_size"]
    else:
        return None
    k = at / n
    at_n = dataclasses.replace(cfg, backend=dataclasses.replace(cfg.backend, world_size=n))
    got = simulated_step(at_n, summary["params"], compute * k, None if backward is None else backward * k, alpha)
    return None if got is None else float(got.step_s)


def simulated_spans(cfg: Config, phi: float, compute_s: float, backward_s: float | None, alpha_s: float) -> Any:
    """The timeline (psarch.timeline.Span list) of one step of `cfg`'s program in full, played from idle links on
    its emulated links as simulated_step plays it; None where the backend writes no program."""
    from psarch.theory.simulate import spans

    got = program_on_links(cfg, phi, compute_s, backward_s, alpha_s)
    return None if got is None else spans(*got)


def program_on_links(cfg: Config, phi: float, compute_s: float, backward_s: float | None, alpha_s: float) -> Any:
    """(program, cluster): `cfg`'s step program in full, ranks computing `compute_s` (`backward_s` of it backward)
    on the config's modelled device (its rates price what a program adds, a compression's work), and its emulated
    links (payload rates, WIRE_OVERHEAD counted, α per message); None where it writes none."""
    import dataclasses

    from psarch.cluster.device import rates
    from psarch.theory.program import Cluster, DataStep

    flops, memory = rates(cfg)
    step = dataclasses.replace(DataStep.of(compute_s, backward_s), flops_per_s=flops, memory_bytes_per_s=memory)
    program = registry.spec_of(cfg).program(cfg, phi, step, reduced=False)
    if program is None:
        return None
    c = cfg.cluster
    rate = c.link_mbps * 1e6 / 8 / WIRE_OVERHEAD
    return program, Cluster.of(program, rate, alpha_s, c.server_mbps * 1e6 / 8 / WIRE_OVERHEAD)
