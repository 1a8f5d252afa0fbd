"""The runs test_ps_checkpoint.py looks at: two workers, two servers (threads of the test process), a tiny GPT
(sync-fp16 with each server's range in partitions, sync with priority and ssp with partitions dealt to the
servers round robin: each partition's records and loss scaler are its own).
(And three workers with a straggler, for sync's worker-order sums: see N3 below.)
Stage 1 runs every case 6 steps with a checkpoint every 3. Stage 2 resumes the sync cases from step 3 to 6,
restores each timing-dependent case (async with DC-ASGD, SSP, GEO mid-round) and writes the restored state
again as checkpoint 3 of another folder, and forks the sync checkpoint onto ddp, async and GEO."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import checkpoint_runs as cr
from psarch.checkpoint import Checkpoint
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.records import ServiceInfo
from psarch.ps.services import start_services
from psarch.ps.worker.trainer import PSWorker
from psarch.launch.runner import run_rank
from psarch.workload import build_workload
from ps_setup import ps

N, SERVERS, STEPS, AT = 2, 2, 6, 3
PARTS = {"partition_mb": 0.001, "partition_assignment": "ranges"}   # 256 elements: each server's range in several
DEALT = {**PARTS, "partition_assignment": "round_robin"}   # the same partitions, dealt to the servers in turn
CASES = {"sync-fp32": ("fp32", {}), "sync-fp16": ("fp16", PARTS),
         "sync-priority": ("fp32", {**DEALT, "priority_credit_mb": 0.001}),   # a checkpoint settles the pulls in flight
         "async-dc": ("fp32", {"mode": "async", "staleness_compensation": "dc"}),
         "ssp": ("fp32", {"mode": "ssp", "staleness_bound": 1, **DEALT}),
         "geo": ("fp32", {"mode": "geo", "k_steps": 2})}   # checkpoint 3 falls mid-round: local != synced
EXACT = [c for c in CASES if c.startswith("sync")]
RESTORED = [c for c in CASES if c not in EXACT]
FORKS = {"sync-to-async": "async-dc", "sync-to-geo": "geo"}   # sync-fp32's checkpoint continued in these modes


def config(name: str, case: str, **train: Any) -> dict:
    precision, backend = CASES[case]
    return cr.config(name, precision, ps(N, servers=SERVERS, **backend), N, steps=STEPS, **train)


def checkpoint(out: Path, case: str) -> Path:
    return out / case / "checkpoints" / f"step_{AT:06d}"


def _ctx(rank: int, info: dict, group: bool = False) -> DistContext:
    ctx = DistContext(rank, N, rank, torch.device("cpu"), "gloo" if group else None)
    ctx.services = info if isinstance(info, ServiceInfo) else ServiceInfo.from_dict(info)
    return ctx


def _steps(record: dict) -> list[dict]:
    return [{k: r.get(k) for k in cr.ROW_KEYS} for r in record.steps]


def straight(rank: int, n: int, out: str, infos: dict) -> dict:
    o, results = Path(out), {}
    for case in CASES:
        record = run_rank(from_dict(config(case, case, checkpoint_every=AT)), _ctx(rank, infos[case]), echo=False,
                          checkpoints=o / case / "checkpoints")
        if rank == 0:
            torch.save(record.model_state, o / f"{case}.pt")
        results[case] = _steps(record)
    return results


def _restore_and_save(rank: int, o: Path, case: str, info: dict) -> list[float]:
    """Restore a worker from the checkpoint, write its state again as checkpoint 3 under `case-again`, step on."""
    cfg = from_dict(config(f"{case}-again", case, checkpoint_every=AT))
    workload = build_workload(cfg)
    trainer = PSWorker(workload, cfg, _ctx(rank, info))
    ckpt = Checkpoint(checkpoint(o, case))
    try:
        trainer.load_checkpoint(ckpt)
        trainer.write_checkpoint(_ctx(rank, info), o / f"{case}-again" / "checkpoints", AT, cfg.to_dict(), 0,
                                 ckpt.steps(rank))
        losses = [trainer.step(workload.batch(s, rank, N)).loss for s in range(AT, STEPS)]
        trainer.full_state_dict()
    finally:
        ckpt.close()
        trainer.close()
    return losses


def resumed(rank: int, n: int, out: str, infos: dict) -> dict:
    o, results = Path(out), {}
    for case in EXACT:
        record = run_rank(from_dict(config(f"{case}-resumed", case)), _ctx(rank, infos[case]), echo=False,
                          start=checkpoint(o, case), resume=True)
        if rank == 0:
            torch.save(record.model_state, o / f"{case}-resumed.pt")
        results[case] = _steps(record)
    for case in RESTORED:
        results[case] = _restore_and_save(rank, o, case, infos[case])
    for fork, case in FORKS.items():   # to step 6, checkpointed there
        run_rank(from_dict(config(fork, case, checkpoint_every=AT)), _ctx(rank, infos[fork]), echo=False,
                 start=checkpoint(o, "sync-fp32"), checkpoints=o / fork / "checkpoints")
    # the sync checkpoint forks onto ddp (this group is a gloo group)
    data = cr.config("ps-to-ddp", "fp32", {"kind": "ddp", "comm": "ring", "world_size": N}, N, steps=STEPS)
    record = run_rank(from_dict(data), _ctx(rank, {}, group=True), echo=False, start=checkpoint(o, "sync-fp32"))
    if rank == 0:
        torch.save(record.model_state, o / "ps-to-ddp.pt")
    return results


def servers(out: Path, stage: str) -> dict:
    """Each case's servers for a stage, started from step 3's checkpoint in stage 2."""
    started = {}
    if stage != "straight":
        for fork, case in FORKS.items():
            started[fork] = start_services(from_dict(config(fork, case, checkpoint_every=AT)), out / fork,
                                           threads=True, start=checkpoint(out, "sync-fp32"))
    for case in CASES if stage == "straight" else EXACT + RESTORED:
        folder, start = (case, None) if stage == "straight" else (
            f"{case}-resumed" if case in EXACT else f"{case}-again", checkpoint(out, case))
        every = AT if stage == "straight" or case in RESTORED else 0
        started[case] = start_services(from_dict(config(folder, case, checkpoint_every=every)), out / folder,
                                       threads=True, start=start)
    return started



# Three workers: from N = 3 a sync round's sum would depend on which worker arrives last, were it summed in
# arrival order. A straggler (cluster.slow_workers) decides who does: worker 0 in one run, worker 2 in another.
N3 = 3
SKEWED = {"n3-slow0": 0, "n3-slow2": 2, "n3-slow2-resumed": 2}   # run -> its slow worker


def skewed_config(name: str, **train: Any) -> dict:
    data = cr.config(name, "fp32", ps(N3, servers=SERVERS), N3, steps=STEPS, **train)
    data["cluster"] = {"slow_workers": [SKEWED[name]], "slowdown": 40.0}
    return data


def skewed_servers(out: Path, stage: str) -> dict:
    """Stage "straight": n3-slow0 (a checkpoint every 3) and n3-slow2; stage "resumed": n3-slow2 from n3-slow0's."""
    if stage == "straight":
        return {"n3-slow0": start_services(from_dict(skewed_config("n3-slow0", checkpoint_every=AT)),
                                           out / "n3-slow0", threads=True),
                "n3-slow2": start_services(from_dict(skewed_config("n3-slow2")), out / "n3-slow2", threads=True)}
    return {"n3-slow2-resumed": start_services(from_dict(skewed_config("n3-slow2-resumed")), out / "n3-slow2-resumed",
                                               threads=True, start=checkpoint(out, "n3-slow0"))}


def skewed(rank: int, n: int, out: str, infos: dict) -> dict:
    """Each run of the stage (infos: its servers) to step 6; rank 0 saves the model as `out/<run>.pt`."""
    o, results = Path(out), {}
    for name, info in infos.items():
        resumed_run = name.endswith("resumed")
        ctx = DistContext(rank, N3, rank, torch.device("cpu"), None)
        ctx.services = info if isinstance(info, ServiceInfo) else ServiceInfo.from_dict(info)
        train = {"checkpoint_every": AT} if name == "n3-slow0" else {}
        record = run_rank(from_dict(skewed_config(name, **train)), ctx, echo=False,
                          checkpoints=o / name / "checkpoints" if train else None,
                          start=checkpoint(o, "n3-slow0") if resumed_run else None, resume=resumed_run)
        if rank == 0:
            torch.save(record.model_state, o / f"{name}.pt")
        results[name] = _steps(record)
    return results
