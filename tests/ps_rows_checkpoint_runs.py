"""The runs test_ps_rows_checkpoint.py looks at: two workers, two row servers (threads of the test process), a
small dlrm (2 tables x 100 rows; sync-topk with top-k dense pushes). Stage 1 runs every case 4 steps with a checkpoint every 3 (and a dense ddp
run). Stage 2 resumes the sync cases from step 3, restores async and GEO (mid-round: its RowCache holds rows)
and writes them again as checkpoint 3 of another folder, forks sync-adagrad's checkpoint onto ddp rows,
ddp sharded and single, and the dense ddp checkpoint onto ps rows."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import parity
from psarch.checkpoint import Checkpoint
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.records import ServiceInfo
from psarch.ps.services import start_services
from psarch.ps.worker.trainer import PSWorker
from psarch.launch.runner import run_rank
from psarch.workload import build_workload

N, SERVERS, STEPS, AT = 2, 2, 4, 3
DLRM = {"seed": 5,
        "workload": {"model": "dlrm", "data": "clicks",
                     "dlrm": {"num_tables": 2, "rows": 100, "dim": 4, "bag": 2, "bottom_mlp": [8], "top_mlp": [8]},
                     "clicks": {"zipf": 1.05, "dense": 4}},
        "train": {"steps": STEPS, "global_batch": 16, "log_every": 100}}
OPTIMIZERS = {"sgd": {"optimizer": "sgd", "lr": 0.5},
              "adagrad": {"optimizer": "adagrad", "lr": 0.1, "eps": 1e-6, "initial_accumulator_value": 0.1},
              "adamw": {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6},   # lazy on the rows
              # top-k dense pushes beside the rows: each worker's error feedback must come back
              "sgd-topk": {"optimizer": "sgd", "lr": 0.5, "compression": "topk", "topk_ratio": 0.25}}
PS = {"kind": "ps", "servers": SERVERS, "timeout_s": 60.0, "embeddings": "rows"}
CASES = {"sync-sgd": ("sgd", dict(PS, mode="sync")), "sync-adagrad": ("adagrad", dict(PS, mode="sync")),
         "sync-topk": ("sgd-topk", dict(PS, mode="sync")),
         "async-adamw": ("adamw", dict(PS, mode="async")),
         "geo-adagrad": ("adagrad", dict(PS, mode="geo", k_steps=2))}   # checkpoint 3: mid-round
EXACT, RESTORED = ["sync-sgd", "sync-adagrad", "sync-topk"], ["async-adamw", "geo-adagrad"]
DENSE = ("adagrad", {"kind": "ddp", "comm": "ring"})                     # forked onto ps rows
FORKS = {"to-ddp-rows": ("adagrad", {"kind": "ddp", "comm": "ring", "embeddings": "rows", "bucket_cap_mb": 0}),
         "to-ddp-sharded": ("adagrad", {"kind": "ddp", "comm": "ring", "embeddings": "sharded"}),
         "to-single": ("adagrad", {"kind": "single"})}                   # from sync-adagrad's checkpoint


def config(name: str, opt: str, backend: dict, **train: Any) -> dict:
    n = 1 if backend["kind"] == "single" else N
    return parity.config(name, DLRM, train=dict(OPTIMIZERS[opt], **train), backend=dict(backend, world_size=n))


def case_config(name: str, case: str, **train: Any) -> dict:
    return config(name, *CASES[case], **train)


def checkpoint(out: Path, run: str) -> Path:
    return out / run / "checkpoints" / f"step_{AT:06d}"


def _ctx(rank: int, info: dict, n: int = N) -> DistContext:
    ctx = DistContext(rank, n, rank, torch.device("cpu"), "gloo" if n > 1 else None)
    ctx.services = info if isinstance(info, ServiceInfo) else ServiceInfo.from_dict(info)
    return ctx


def _run(rank: int, out: Path, data: dict, info: dict, **kw: Any) -> list[float]:
    record = run_rank(from_dict(data), _ctx(rank, info), echo=False, **kw)
    if rank == 0:
        torch.save(record.model_state, out / f"{data['name']}.pt")
    return [r["loss"] for r in record.steps]


def straight(rank: int, n: int, out: str, infos: dict) -> dict:
    o = Path(out)
    results = {case: _run(rank, o, case_config(case, case, checkpoint_every=AT), infos[case],
                          checkpoints=o / case / "checkpoints") for case in CASES}
    _run(rank, o, config("dense", *DENSE, checkpoint_every=AT), {}, checkpoints=o / "dense" / "checkpoints")
    return results


def _restore_and_save(rank: int, o: Path, case: str, info: dict) -> None:
    """Restore a worker from the checkpoint, write its state again as checkpoint 3 under `case-again`, step on."""
    cfg = from_dict(case_config(f"{case}-again", case, checkpoint_every=AT))
    workload = build_workload(cfg)
    trainer = PSWorker(workload, cfg, _ctx(rank, info))
    ckpt = Checkpoint(checkpoint(o, case))
    try:
        trainer.load_checkpoint(ckpt)
        trainer.write_checkpoint(_ctx(rank, info), o / f"{case}-again" / "checkpoints", AT, cfg.to_dict(), 0,
                                 ckpt.steps(rank))
        for s in range(AT, STEPS):
            trainer.step(workload.batch(s, rank, N))
        trainer.full_state_dict()
    finally:
        ckpt.close()
        trainer.close()


def resumed(rank: int, n: int, out: str, infos: dict) -> dict:
    o, results = Path(out), {}
    for case in EXACT:
        results[case] = _run(rank, o, case_config(f"{case}-resumed", case), infos[case], start=checkpoint(o, case),
                             resume=True)
    for case in RESTORED:
        _restore_and_save(rank, o, case, infos[case])
    _run(rank, o, case_config("from-dense", "sync-adagrad"), infos["from-dense"], start=checkpoint(o, "dense"))
    for fork, (opt, backend) in FORKS.items():
        if backend["kind"] != "single":
            _run(rank, o, config(fork, opt, backend), {}, start=checkpoint(o, "sync-adagrad"))
        elif rank == 0:   # one process, no group
            record = run_rank(from_dict(config(fork, opt, backend)), _ctx(0, {}, 1), echo=False,
                              start=checkpoint(o, "sync-adagrad"))
            torch.save(record.model_state, o / f"{fork}.pt")
    return results


def servers(out: Path, stage: str) -> dict:
    """Each ps case's servers for a stage; in stage 2 started from a step-3 checkpoint."""
    if stage == "straight":
        return {case: start_services(from_dict(case_config(case, case, checkpoint_every=AT)), out / case,
                                     threads=True) for case in CASES}
    started = {"from-dense": start_services(from_dict(case_config("from-dense", "sync-adagrad")), out / "from-dense",
                                            threads=True, start=checkpoint(out, "dense"))}
    for case in EXACT + RESTORED:
        folder = f"{case}-resumed" if case in EXACT else f"{case}-again"
        every = AT if case in RESTORED else 0
        started[case] = start_services(from_dict(case_config(folder, case, checkpoint_every=every)), out / folder,
                                       threads=True, start=checkpoint(out, case))
    return started
