"""DLRM on clicks: the model's shapes and errors, and parity: every backend at N = 2 (ddp with dense and
with row-sharded tables), with SGD and with Adagrad, ends with the same model as `single` (tolerances of
tests/parity.py). Embedding rows that no sample touches get an exact zero gradient on every backend, so
Adagrad's normalisation sees the same values everywhere; initial_accumulator_value = 0.1 keeps a first step
on a gradient of pure summation noise from moving a parameter by a whole learning rate (as eps does for
AdamW in test_ddp)."""
from __future__ import annotations


import pytest
import torch

from dist_utils import run_ranks
from parity import ATOL, OPTIMIZERS, assert_same_model, config, model, train
from psarch import theory
from psarch.config import from_dict
from psarch.models import DLRM
from psarch.optim import build_optimizer
from psarch.ps.services import start_services
from psarch.workload import build_workload
from timing import scaled

TINY_DLRM = {
    "seed": 4,
    "workload": {"model": "dlrm", "data": "clicks",
                 "dlrm": {"num_tables": 3, "rows": 40, "dim": 4, "bag": 2, "bottom_mlp": [8], "top_mlp": [8]},
                 "clicks": {"zipf": 1.0, "dense": 4}},
    "train": {"steps": 6, "global_batch": 12, "log_every": 100},
}
SPARSE_OPTIMIZERS = {"sgd": OPTIMIZERS["sgd"],
                     "adagrad": {"optimizer": "adagrad", "lr": 0.1, "eps": 1e-6, "weight_decay": 0.01,
                                 "initial_accumulator_value": 0.1}}
N = 2
VARIANTS = {f"ddp-{opt}": ({"kind": "ddp", "comm": "ring", "bucket_cap_mb": 0.001}, opt) for opt in SPARSE_OPTIMIZERS}
VARIANTS.update({"torch_ddp-adagrad": ({"kind": "torch_ddp"}, "adagrad"),
                 "zero1-adagrad": ({"kind": "zero", "stage": 1}, "adagrad"),
                 "zero3-adagrad": ({"kind": "zero", "stage": 3}, "adagrad"),
                 "ps-adagrad": ({"kind": "ps", "mode": "sync", "servers": 2, "timeout_s": 60.0}, "adagrad")})
# row-sharded tables over torch's collectives here; over the ring at N = 3 in tests/test_sharded.py
VARIANTS.update({f"ddp_sharded-{opt}": ({"kind": "ddp", "comm": "native", "embeddings": "sharded"}, opt)
                 for opt in SPARSE_OPTIMIZERS})


def test_dlrm_shapes_and_bad_ids():
    for interaction, top_in in (("dot", 4 + 3 * 4 // 2), ("cat", 4 * 4)):
        m = DLRM(num_dense=5, num_tables=3, rows=10, dim=4, bottom_mlp=[6], top_mlp=[7], interaction=interaction)
        assert m.blocks[1][0].in_features == top_in  # (tables + 1) choose 2 dot products beside the bottom output
        assert m(torch.randn(8, 5), torch.randint(0, 10, (8, 3, 2))).shape == (8,)
    with pytest.raises(ValueError, match=r"ids of shape \(8, 2, 1\): expected \(batch, 3 tables, bag\)"):
        m(torch.randn(8, 5), torch.zeros(8, 2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="interaction = 'sum'"):
        DLRM(5, 3, 10, 4, interaction="sum")


def test_adagrad_is_built_from_the_train_section():
    """One step by hand: acc = a0 + g², p -= lr·(g + wd·p) / (sqrt(acc) + eps) (L2 decay enters g)."""
    t = from_dict({"train": {"optimizer": "adagrad", "lr": 0.5, "eps": 1e-3, "weight_decay": 0.1,
                             "initial_accumulator_value": 0.25}}).train
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = build_optimizer([p], t)
    assert isinstance(opt, torch.optim.Adagrad)
    p.grad = torch.tensor([0.3, 0.0])
    opt.step()
    g = torch.tensor([0.3, 0.0]) + 0.1 * torch.tensor([1.0, -2.0])
    want = torch.tensor([1.0, -2.0]) - 0.5 * g / ((0.25 + g * g).sqrt() + 1e-3)
    torch.testing.assert_close(p.data, want)


def _data(name: str, opt: str, backend: dict | None = None) -> dict:
    return config(name, base=TINY_DLRM, train=SPARSE_OPTIMIZERS[opt],
                  backend=dict(backend or {"kind": "single"}, world_size=N if backend else 1))


def _variants(rank: int, n: int, out: str, infos: dict) -> dict:
    return {name: train(rank, n, _data(name, opt, backend), infos.get(name, {}), out)
            for name, (backend, opt) in VARIANTS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("dlrm")
    for opt in SPARSE_OPTIMIZERS:
        train(0, 1, _data(f"single-{opt}", opt), {}, str(out))
    services = {name: start_services(from_dict(_data(name, opt, backend)), None, threads=True)
                for name, (backend, opt) in VARIANTS.items() if backend["kind"] == "ps"}
    try:
        results = run_ranks(_variants, N, str(out), {k: s.info for k, s in services.items()}, timeout=scaled(300))
        for s in services.values():
            s.finish()
    finally:
        for s in services.values():
            s.stop()
    return out, results


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_backend_equals_single_on_dlrm(runs, name):
    out, _ = runs
    opt = VARIANTS[name][1]
    ref = model(out, f"single-{opt}")
    init = build_workload(from_dict(TINY_DLRM)).model.state_dict()
    assert max((ref[k] - v).abs().max().item() for k, v in init.items()) > 100 * ATOL, "reference barely trained"
    assert_same_model(model(out, name), ref, f"{name} N={N} vs single on dlrm/clicks")


def test_adagrad_state_is_one_fp32_sum_per_parameter(runs):
    """DDP with Adagrad holds K = 4 bytes of optimizer state per parameter (theory's figure), plus
    a 4-byte step counter per stepped tensor (one per parameter tensor at most; flat buffers step fewer);
    ZeRO-1 holds 1/N of it (plus padding and counters)."""
    _, results = runs
    r = results[0]["ddp-adagrad"]
    tensors = len(list(build_workload(from_dict(TINY_DLRM)).model.parameters()))
    assert theory.optimizer_bytes_per_param("adagrad", "fp32") == 4
    assert theory.optimizer_bytes_per_param("adagrad", "bf16") == 8  # + the fp32 master copy
    assert 4 * r["params"] + 4 <= r["memory"]["optimizer"] <= 4 * r["params"] + 4 * tensors
    for rank in range(N):
        z = results[rank]["zero1-adagrad"]["memory"]
        assert 4 * r["params"] / N <= z["optimizer"] <= 4 * r["params"] / N + z["padding"] + 4 * tensors
