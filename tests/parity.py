"""What every parity test shares: the tolerance, the tiny workload and optimizers, and how saved models
are compared.

fp32, rtol 1e-4 / atol 1e-5 on every parameter after a few steps: backends differ only in the order
per-sample gradients are summed (~1e-7 relative per step); a missing or wrong synchronisation moves
parameters by about one learning rate (1e-2), 1000x the tolerance. See tests/test_ddp.py's docstring."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.records import ServiceInfo
from psarch.launch.runner import run_rank

RTOL, ATOL = 1e-4, 1e-5
SGD_ATOL = 1e-5   # issue 23's bound for SGD: every parameter within 1e-5 absolute of single's

TINY_GPT = {
    "seed": 3,
    "workload": {"model": "gpt", "data": "markov", "seq_len": 8,
                 "gpt": {"n_layer": 1, "n_embd": 16, "n_head": 2}, "markov": {"vocab_size": 16, "branching": 3}},
    "train": {"steps": 6, "global_batch": 12, "log_every": 100},
}
OPTIMIZERS = {
    "sgd": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "adamw": {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6},
}


def config(name: str, base: dict = TINY_GPT, **sections) -> dict:
    """A run config as a dict: `base` (a fresh copy) with each section's keys updated, named `name`."""
    data = json.loads(json.dumps(base))
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    data["name"] = name
    return data


def model(out: Path, name: str) -> dict[str, torch.Tensor]:
    """The state_dict a test run saved as `out/name.pt`."""
    return torch.load(out / f"{name}.pt", weights_only=True)


def assert_same_model(a: dict, b: dict, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {k}: {m}")


def train(rank: int, n: int, data: dict, info: dict, out: str, **run) -> dict:
    """Run one config on this rank (inside the caller's process group, with its services' info; `run`: run_rank's
    checkpoint arguments); rank 0 saves the model. Returns what the tests look at."""
    cfg = from_dict(data)
    ctx = DistContext(rank, n, rank, torch.device("cpu"), "gloo" if n > 1 else None)
    ctx.services = info if isinstance(info, ServiceInfo) else ServiceInfo.from_dict(info)
    record = run_rank(cfg, ctx, echo=False, **run)
    if rank == 0:
        torch.save(record.model_state, Path(out) / f"{cfg.name}.pt")
    return {"traffic": record.traffic, "memory": record.memory, "params": record.params,
            "extra": record.extra, "rows": [{k: r[k] for k in ("loss", "sent", "received", "extra")}
                                               for r in record.steps]}


def train_plan(rank: int, n: int, out: str, plan: dict, infos: dict) -> dict:
    """Each of `plan`'s configs (name -> config dict) in turn on this rank, one thread, with its services' `infos`."""
    torch.set_num_threads(1)
    return {name: train(rank, n, data, infos[name], out) for name, data in plan.items()}


def run_plan(plan: dict, served: set, n: int, out: Path) -> dict:
    """`plan`'s configs (name -> config dict) on n ranks, those in `served` with PS servers of their own (threads
    here): each name's per-rank results (train_plan's)."""
    from dist_utils import run_ranks
    from psarch.ps.services import LocalServers
    from timing import scaled
    torch.set_num_threads(1)
    services = {name: LocalServers(from_dict(plan[name]), None, threads=True) for name in served}
    try:
        infos = {name: services[name].info.to_dict() if name in services else {} for name in plan}
        res = run_ranks(train_plan, n, str(out), plan, infos, timeout=scaled(300))
    finally:
        for s in services.values():
            s.stop()
    return {name: [r[name] for r in res] for name in plan}

