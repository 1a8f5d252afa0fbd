"""A user's own model and data (`workload.factory`) trains under every backend, PyTorch's peers included."""
from __future__ import annotations

import json
import re

import torch

import psarch
from dist_utils import run_ranks
from factories import TinyRegressor
from psarch.config import ConfigError, from_dict
from psarch.dist import DistContext
from psarch.registry import kinds
from psarch.launch.runner import run_rank, to_device
from timing import scaled

BASE = {"seed": 1, "workload": {"factory": "factories:regression"},
        "train": {"steps": 30, "global_batch": 16, "optimizer": "adamw", "lr": 0.03, "log_every": 100}}
IN_GROUP = [("ddp", {"comm": "ring"}), ("ddp", {"comm": "native"}), ("zero", {"stage": 1}), ("zero", {"stage": 2}),
            ("zero", {"stage": 3}), ("torch_ddp", {}), ("torch_zero", {}), ("torch_fsdp", {}),
            # a model without units is one stage: two pipelines of 2 micro-batches each, all-reduced
            ("pipeline", {"stages": 1, "microbatches": 2})]


def config(kind: str, n: int, **backend) -> dict:
    return dict(BASE, name=kind, backend=dict(backend, kind=kind, world_size=n))


def losses_and_keys(rank: int, n: int) -> dict:
    out = {}
    for kind, backend in IN_GROUP:
        rec = run_rank(from_dict(config(kind, n, **backend)), DistContext(rank, n, rank, torch.device("cpu"), "gloo"),
                       echo=False)
        out[f"{kind}{backend}"] = {"first": rec.steps[0]["loss"], "last": rec.steps[-1]["loss"],
                                   "keys": sorted(rec.model_state) if rank == 0 else None}
    return out


def refusing_factories() -> dict[str, str]:
    """The backends that refuse a factory's model (tensor parallelism splits only the built-in GPT), with why."""
    out = {}
    for kind in kinds():
        try:
            from_dict(config(kind, 1 if kind == "single" else 2))
        except ConfigError as e:
            out[kind] = str(e)
    return out


def test_factory_workload_trains_under_every_backend_that_accepts_one(tmp_path):
    expected_keys = sorted(TinyRegressor().state_dict())
    results = run_ranks(losses_and_keys, 2, timeout=scaled(300))[0]
    covered = {name.split("{")[0] for name in results}
    single = psarch.run(from_dict(config("single", 1)), out=tmp_path / "single", echo=False)
    ps = psarch.run(from_dict(config("ps", 2)), out=tmp_path / "ps", echo=False)
    in_process = {"single": single, "ps": ps, "dp": psarch.run(from_dict(config("dp", 2)), out=tmp_path / "dp", echo=False)}
    # torch.nn.DataParallel runs on CUDA devices only: here where 2 are visible
    no_gpus = {"torch_dp"} if torch.cuda.device_count() < 2 else set()
    if not no_gpus:
        in_process["torch_dp"] = psarch.run(from_dict(config("torch_dp", 2)), out=tmp_path / "torch_dp", echo=False)
    covered |= set(in_process)
    refused = refusing_factories()
    for kind, why in refused.items():
        assert why.startswith('workload.factory = "factories:regression"') and re.search(r"\(use (pipeline, )?ddp or zero\)$", why), why
    assert covered == set(kinds()) - set(refused) - no_gpus, \
        f"backends not exercised: {set(kinds()) - covered - set(refused) - no_gpus}"
    assert covered.isdisjoint(refused)
    for name, r in results.items():
        assert r["last"] < 0.3 * r["first"], f"{name} did not learn: {r['first']:.4f} -> {r['last']:.4f}"
        assert r["keys"] == expected_keys, name
    for run, s in in_process.items():
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert s["final_loss"] < 0.3 * rows[0]["loss"], run
        state = torch.load(tmp_path / run / "model.pt", weights_only=True)
        TinyRegressor().load_state_dict(state)  # strict: the plain model loads it


# ---------------------------------------------------------------- low precision: the runner casts float batches

README = {"seed": 1, "workload": {"factory": "factories:readme_example"},
          "train": {"steps": 30, "global_batch": 16, "optimizer": "adamw", "lr": 0.03, "log_every": 100,
                    "precision": "bf16"}}
README_DDP = [{"comm": "ring"}, {"comm": "native"}]


def readme_losses(rank: int, n: int) -> dict:
    out = {}
    for backend in README_DDP:
        cfg = from_dict(dict(README, name="ddp", backend=dict(backend, kind="ddp", world_size=n)))
        rows = run_rank(cfg, DistContext(rank, n, rank, torch.device("cpu"), "gloo"), echo=False).steps
        out[backend["comm"]] = [r["loss"] for r in rows]
    return out


def test_readme_factory_trains_in_bf16_without_casting_its_input():
    """The README's factory feeds float32 x to a bf16 model (no cast in its loss_fn): without the runner's
    cast, the first forward raises "mat1 and mat2 must have the same dtype"."""
    single = run_rank(from_dict(dict(README, name="single")), DistContext(), echo=False)
    runs = {"single": [r["loss"] for r in single.steps], **run_ranks(readme_losses, 2, timeout=scaled(300))[0]}
    for name, losses in runs.items():
        assert losses[-1] < 0.3 * losses[0], f"{name} bf16 did not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_to_device_casts_floating_tensors_only():
    ints, floats = torch.arange(6).reshape(2, 3), torch.randn(2, 3, dtype=torch.float64)
    batch = {"tokens": ints, "pair": (floats, [floats.float()]), "n": 3}
    cast = to_device(batch, torch.device("cpu"), torch.bfloat16)
    assert cast["tokens"].dtype == torch.int64 and torch.equal(cast["tokens"], ints)   # tokens untouched
    assert cast["pair"][0].dtype == torch.bfloat16 and cast["pair"][1][0].dtype == torch.bfloat16
    assert isinstance(cast["pair"], tuple) and isinstance(cast["pair"][1], list) and cast["n"] == 3
    same = to_device(batch, torch.device("cpu"))                                      # fp32 runs: as given
    assert same["pair"][0].dtype == torch.float64 and torch.equal(same["pair"][0], floats)
