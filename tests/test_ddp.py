"""DDP parity: psarch DDP (ring and native) ends with the same model as `single` and as torch DDP.

Tolerance: fp32, rtol 1e-4 / atol 1e-5 on every parameter after 6 steps. The only difference between
the runs is the order in which per-sample gradients are summed (a shard's mean, divided by N, summed
over ranks in ring order, vs one mean over the global batch): ~1e-7 relative per step. AdamW uses
eps = 1e-6: a parameter whose true gradient is zero (the attention key bias) has a gradient of pure
summation noise, which Adam would otherwise blow up to ~lr per step; eps bounds that at lr·noise/eps.
A missing or wrong synchronisation moves parameters by about one learning rate (1e-2), 1000x the
tolerance. Each world size runs every variant inside one spawned process group (start-up is the
expensive part on 2 cores); the launcher itself is tested end to end in test_cli.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks
from parity import ATOL, OPTIMIZERS, TINY_GPT, assert_same_model, config, model
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.launch.runner import run_rank
from psarch.workload import build_workload
from timing import scaled

PERTURBED = {"factory": "factories:perturbed_by_rank"}  # every rank builds a different initial model
VARIANTS = [("torch_ddp", {}), ("ddp", {"comm": "ring", "bucket_cap_mb": 0.01}),
            ("ddp", {"comm": "native", "bucket_cap_mb": 0.01})]


def train(rank: int, n: int, data: dict, out: str) -> dict:
    """Run one config on this rank inside the existing process group; rank 0 saves the model."""
    cfg = from_dict(data)
    record = run_rank(cfg, DistContext(rank, n, rank, torch.device("cpu"), "gloo"), echo=False)
    if rank == 0:
        torch.save(record.model_state, Path(out) / f"{cfg.name}.pt")
    return {"traffic": record.traffic, "memory": record.memory, "params": record.params,
            "rows": [{k: r[k] for k in ("loss", "sent", "received", "skipped", "loss_scale")} for r in record.steps]}


def all_variants(rank: int, n: int, out: str) -> dict:
    results = {}
    for opt, hp in OPTIMIZERS.items():
        for kind, backend in VARIANTS:
            name = f"{kind}-{backend.get('comm', '')}-{opt}-{n}"
            results[name] = train(rank, n, config(name, train=hp, backend=dict(backend, kind=kind, world_size=n)), out)
    for kind, backend in VARIANTS:
        name = f"perturbed-{kind}-{backend.get('comm', '')}-{n}"
        results[name] = train(rank, n, config(name, train=OPTIMIZERS["sgd"], workload=PERTURBED,
                                              backend=dict(backend, kind=kind, world_size=n)), out)
    if n == 2:
        for name, backend in (("plain", {"bucket_cap_mb": 0, "overlap_comm": False}),
                              ("fast", {"bucket_cap_mb": 0.005, "overlap_comm": True})):
            results[name] = train(rank, n, config(name, train=OPTIMIZERS["adamw"],
                                                  backend=dict(backend, kind="ddp", world_size=n)), out)
        for precision in ("bf16", "fp16"):
            results[precision] = train(rank, n, config(
                precision, train={"optimizer": "adamw", "lr": 1e-2, "steps": 40, "precision": precision},
                workload={"model": "mlp"}, backend={"kind": "ddp", "world_size": n}), out)
        results["overflow"] = train(rank, n, config(
            "overflow", train={"optimizer": "sgd", "lr": 0.05, "steps": 6, "precision": "fp16", "global_batch": 8},
            workload={"factory": "factories:overflow_at_steps_3_and_4"}, backend={"kind": "ddp", "world_size": n}), out)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    for opt, hp in OPTIMIZERS.items():
        train(0, 1, config(f"single-{opt}", train=hp), str(out))
    train(0, 1, config("perturbed-single", train=OPTIMIZERS["sgd"], workload=PERTURBED), str(out))  # rank 0's model
    results = {}
    for n in (2, 3):
        for rank, res in enumerate(run_ranks(all_variants, n, str(out), timeout=scaled(300))):
            for name, r in res.items():
                results.setdefault(name, {})[rank] = r
    return out, results


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [2, 3])
def test_ddp_equals_single_and_torch_ddp(runs, opt, n):
    out, results = runs
    ref = model(out, f"single-{opt}")
    init = build_workload(from_dict(TINY_GPT)).model.state_dict()
    assert max((ref[k] - v).abs().max().item() for k, v in init.items()) > 100 * ATOL, "reference barely trained"
    torch_ddp = model(out, f"torch_ddp--{opt}-{n}")
    assert_same_model(torch_ddp, ref, f"torch DDP N={n} vs single")
    for comm in ("ring", "native"):
        mine = model(out, f"ddp-{comm}-{opt}-{n}")
        assert_same_model(mine, ref, f"psarch DDP {comm} N={n} vs single")
        assert_same_model(mine, torch_ddp, f"psarch DDP {comm} N={n} vs torch DDP")


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_starts_from_rank_0s_model(runs, n):
    """Every rank builds a different initial model (rank r's is shifted by 0.5 r); the broadcast at
    construction gives every rank rank 0's, so DDP ends where `single` started from rank 0's model ends.
    Without it the ranks' gradients come from different models and rank 0 ends ~lr away."""
    out, _ = runs
    ref = model(out, "perturbed-single")
    for kind, backend in VARIANTS:
        mine = model(out, f"perturbed-{kind}-{backend.get('comm', '')}-{n}")
        assert_same_model(mine, ref, f"{kind} {backend} N={n} from perturbed ranks vs single from rank 0")


def test_bucketed_overlapped_equals_plain_per_parameter(runs):
    """Buckets launched from hooks during backward == one all-reduce per parameter after backward."""
    out, _ = runs
    assert_same_model(model(out, "fast"), model(out, "plain"), "bucketed vs plain")


@pytest.mark.parametrize("n", [2, 3])
def test_traffic_per_step_is_the_ring_volume(runs, n):
    """Ring (measured) and native (modelled): per step 2(N-1)/N·S, plus each bucket's padding to a
    multiple of N (at most N-1 elements, i.e. 2(N-1)·(N-1)·4 bytes, a bucket)."""
    _, results = runs
    for comm in ("ring", "native"):
        for rank, r in results[f"ddp-{comm}-sgd-{n}"].items():
            assert r["traffic"]["modelled"] is (comm == "native")
            phi = r["params"]
            predicted = 2 * (n - 1) / n * phi * 4
            buckets = -(-phi * 4 // int(0.01 * 2**20)) + 16  # bucket count, parameter boundaries included
            for row in r["rows"]:
                assert predicted <= row["sent"] <= predicted + buckets * 2 * (n - 1) ** 2 * 4
                assert row["sent"] == row["received"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_converges_with_fp32_masters(runs, precision):
    _, results = runs
    r = results[precision][0]
    losses = [x["loss"] for x in r["rows"]]
    assert losses[0] - losses[-1] > 1.0, f"{precision} DDP did not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"
    m, phi = r["memory"], r["params"]
    assert m["params"] == m["grads"] == 2 * phi                # the model and its gradients in 16 bits
    assert m["optimizer"] == (8 + 4) * phi + 4                 # Adam moments + fp32 masters + step counter


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(runs):
    _, results = runs
    for rank, r in results["overflow"].items():
        assert [x["skipped"] for x in r["rows"]] == [False, False, False, True, True, False]
        # hysteresis 2: the first overflow keeps the scale, the second halves it
        assert [x["loss_scale"] for x in r["rows"]] == [2.0**16] * 4 + [2.0**15] * 2
