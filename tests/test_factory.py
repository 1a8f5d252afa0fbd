"""A user's own model and data (`workload.factory`) trains under every backend, PyTorch's peers included."""
from __future__ import annotations

import json

import torch

import psarch
from dist_utils import run_ranks
from factories import TinyRegressor
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.registry import BACKENDS
from psarch.runner import run_rank

BASE = {"seed": 1, "workload": {"factory": "factories:regression"},
        "train": {"steps": 30, "global_batch": 16, "optimizer": "adamw", "lr": 0.03, "log_every": 100}}
IN_GROUP = [("ddp", {"comm": "ring"}), ("ddp", {"comm": "native"}), ("zero", {"stage": 1}), ("zero", {"stage": 2}),
            ("zero", {"stage": 3}), ("torch_ddp", {}), ("torch_zero", {}), ("torch_fsdp", {})]


def config(kind: str, n: int, **backend) -> dict:
    return dict(BASE, name=kind, backend=dict(backend, kind=kind, world_size=n))


def losses_and_keys(rank: int, n: int) -> dict:
    out = {}
    for kind, backend in IN_GROUP:
        rec = run_rank(from_dict(config(kind, n, **backend)), DistContext(rank, n, rank, torch.device("cpu"), "gloo"),
                       echo=False)
        out[f"{kind}{backend}"] = {"first": rec["rows"][0]["loss"], "last": rec["rows"][-1]["loss"],
                                   "keys": sorted(rec["model_state"]) if rank == 0 else None}
    return out


def test_factory_workload_trains_under_every_backend(tmp_path):
    expected_keys = sorted(TinyRegressor().state_dict())
    results = run_ranks(losses_and_keys, 2, timeout=300)[0]
    covered = {name.split("{")[0] for name in results}
    single = psarch.run(from_dict(config("single", 1)), out=tmp_path / "single", echo=False)
    ps = psarch.run(from_dict(config("ps", 2)), out=tmp_path / "ps", echo=False)
    covered |= {"single", "ps"}
    assert covered == set(BACKENDS), f"backends not exercised: {set(BACKENDS) - covered}"
    for name, r in results.items():
        assert r["last"] < 0.3 * r["first"], f"{name} did not learn: {r['first']:.4f} -> {r['last']:.4f}"
        assert r["keys"] == expected_keys, name
    for run, s in (("single", single), ("ps", ps)):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert s["final_loss"] < 0.3 * rows[0]["loss"], run
        state = torch.load(tmp_path / run / "model.pt", weights_only=True)
        TinyRegressor().load_state_dict(state)  # strict: the plain model loads it
