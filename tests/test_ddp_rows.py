"""ddp with embeddings = "rows" (ring and native) and its peer torch_ddp with sparse=True embeddings, on
dlrm/clicks at N = 2 and 3: parity with `single` (tests/parity.py tolerances) with SGD and Adagrad (ddp
also with L2 weight decay and AdamW: its table gradient is the dense one), and bytes per step equal to
the all-gather formula (collective_theory.rows_all_gather_bytes) given the distinct ids measured on every rank.
torch's optimizers refuse weight decay on sparse gradients, so torch_ddp runs without it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from collective.comm import ring_bytes
from dist_utils import run_ranks
from parity import ATOL, OPTIMIZERS, assert_same_model, config, model
from collective import theory as collective_theory
from psarch import registry, theory
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.launch.runner import run_rank
from psarch.embeddings import embedding_tables
from psarch.workload import build_workload
from timing import scaled

TINY_DLRM = {
    "seed": 5,
    "workload": {"model": "dlrm", "data": "clicks",
                 "dlrm": {"num_tables": 3, "rows": 40, "dim": 4, "bag": 2, "bottom_mlp": [8], "top_mlp": [8]},
                 "clicks": {"zipf": 1.0, "dense": 4}},
    "train": {"steps": 5, "global_batch": 12, "log_every": 100},
}
ADAGRAD = {"optimizer": "adagrad", "lr": 0.1, "eps": 1e-6, "initial_accumulator_value": 0.1}
OPTIM = {"sgd": OPTIMIZERS["sgd"], "adagrad": dict(ADAGRAD, weight_decay=0.01), "adamw": OPTIMIZERS["adamw"],
         "sgd0": dict(OPTIMIZERS["sgd"], weight_decay=0.0), "adagrad0": ADAGRAD}
ROWS = {"embeddings": "rows", "bucket_cap_mb": 0}   # a dense bucket per parameter beside the tables
VARIANTS = {**{f"ddp-{comm}-{opt}": (dict(ROWS, kind="ddp", comm=comm), opt)
               for comm in ("ring", "native") for opt in ("sgd", "adagrad")},
            **{f"torch_ddp-{opt}": ({"kind": "torch_ddp", "embeddings": "rows"}, opt) for opt in ("sgd0", "adagrad0")}}
ONLY_N2 = {"ddp-ring-adamw": (dict(ROWS, kind="ddp", comm="ring"), "adamw")}


def _data(name: str, opt: str, backend: dict | None = None, n: int = 1) -> dict:
    return config(name, base=TINY_DLRM, train=OPTIM[opt], backend=dict(backend or {"kind": "single"}, world_size=n))


def _train(rank: int, n: int, data: dict, out: str) -> dict:
    cfg = from_dict(data)
    record = run_rank(cfg, DistContext(rank, n, rank, torch.device("cpu"), "gloo" if n > 1 else None), echo=False)
    if rank == 0:
        torch.save(record.model_state, Path(out) / f"{cfg.name}.pt")
    return {"params": record.params, "traffic": record.traffic, "memory": record.memory,
            "rows": [{k: r[k] for k in ("sent", "received", "extra")} for r in record.steps]}


def _variants(rank: int, n: int, out: str) -> dict:
    torch.set_num_threads(1)
    chosen = {**VARIANTS, **(ONLY_N2 if n == 2 else {})}
    return {name: _train(rank, n, _data(f"{name}-n{n}", opt, backend, n), out)
            for name, (backend, opt) in chosen.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("ddp_rows")
    for opt in OPTIM:
        _train(0, 1, _data(f"single-{opt}", opt), str(out))
    return out, {n: run_ranks(_variants, n, str(out), timeout=scaled(300)) for n in (2, 3)}


CASES = [(name, n) for n in (2, 3) for name in VARIANTS] + [(name, 2) for name in ONLY_N2]


@pytest.mark.parametrize("name, n", CASES)
def test_rows_equal_single(runs, name, n):
    out, _ = runs
    opt = {**VARIANTS, **ONLY_N2}[name][1]
    ref = model(out, f"single-{opt}")
    init = build_workload(from_dict(TINY_DLRM)).model.state_dict()
    assert max((ref[k] - v).abs().max().item() for k, v in init.items()) > 100 * ATOL, "reference barely trained"
    assert_same_model(model(out, f"{name}-n{n}"), ref, f"{name} N={n} vs single")


@pytest.mark.parametrize("name, n", CASES)
def test_bytes_per_step_are_the_all_gather_formula(runs, name, n):
    """Dense buckets: the ring all-reduce's volume; tables: (N-1)(8 T + 8 U + 4 Σ u·dim), U the busiest
    rank's distinct ids (ddp pads to it) or this rank's own (torch's gloo all-gathers unpadded)."""
    _, results = runs
    backend = {**VARIANTS, **ONLY_N2}[name][0]
    cfg = from_dict(_data(name, "sgd0", backend, n))
    m = build_workload(cfg).model
    tables = {id(t.weight) for _, t in embedding_tables(m)}
    dense = [p.numel() for p in m.parameters() if id(p) not in tables]
    dim = cfg.workload.dlrm.dim
    for rank in range(n):
        for step, row in enumerate(results[n][rank][name]["rows"]):
            every = [results[n][r][name]["rows"][step]["extra"]["unique_ids"] for r in range(n)]
            assert every[rank] == row["extra"]["unique_ids"] and min(every) >= 3   # an id per table at least
            if backend["kind"] == "ddp":
                u = max(every)
                # bucket_cap_mb = 0: every dense parameter is a bucket of its own
                ring = sum(ring_bytes("all_reduce", k, 4, n)[0] for k in dense)
            else:
                u = every[rank]
                ring = 2 * (n - 1) * (4 * sum(dense)) // n
            want = ring + collective_theory.rows_all_gather_bytes(n, 3, u, u * dim, 4)
            assert row["sent"] == row["received"] == want, f"{name} N={n} rank {rank} step {step}"


def test_prediction_is_the_formula_at_the_expected_unique_ids(runs):
    """summary's prediction: the same formula at E[u] (clicks.expected_unique), near the measured mean."""
    from psarch.zipf import expected_unique
    _, results = runs
    cfg = from_dict(_data("p", "sgd0", VARIANTS["torch_ddp-sgd0"][0], 2))
    phi = results[2][0]["torch_ddp-sgd0"]["params"]
    u = 3 * expected_unique(40, 1.0, 6 * 2)
    dense = phi - 3 * 40 * 4
    want = (dense * 4 + collective_theory.rows_all_gather_bytes(2, 3, u, u * 4, 4))
    assert theory.predict(cfg, phi).link.sent == pytest.approx(want)
    measured = [r["extra"]["unique_ids"] for rank in results[2] for r in rank["torch_ddp-sgd0"]["rows"]]
    assert sum(measured) / len(measured) == pytest.approx(u, rel=0.25)


@pytest.mark.parametrize("n", (2, 3))
def test_torch_ddp_holds_sparse_table_gradients(runs, n):
    """After gloo's sparse all-reduce each table's gradient is one (int64 id, row) per distinct id of the
    last global batch, beside the dense layers' gradients: torch DDP really ran the sparse path."""
    _, results = runs
    cfg = from_dict(_data("m", "sgd0", VARIANTS["torch_ddp-sgd0"][0], n))
    w = build_workload(cfg)
    last = w.batch(cfg.train.steps - 1, 0, 1)
    touched = sum(len(torch.unique(last[1][:, t])) for t in range(3))
    dense = results[n][0]["torch_ddp-sgd0"]["params"] - 3 * 40 * 4
    for rank in range(n):
        assert results[n][rank]["torch_ddp-sgd0"]["memory"]["grads"] == 4 * dense + touched * (8 + 4 * 4)


def test_step_program_counts_buckets_of_the_dense_layers_only():
    """With rows, the tables leave the bucketed all-reduce: at 4 x 10^6 x 16 (256 MB) dense ddp fills
    ceil(256 MB / 25 MiB) = 10 buckets, ddp rows one (its ~20 KB of dense layers): the all-reduces of its step
    program (reduced: one per bucket)."""
    from psarch.theory.program import DataStep, Transfer

    def buckets(embeddings: str) -> int:
        cfg = from_dict({"workload": {"model": "dlrm", "data": "clicks", "dlrm": {"rows": 10**6}},
                         "train": {"optimizer": "adagrad"},
                         "backend": {"kind": "ddp", "world_size": 4, "embeddings": embeddings}})
        p = registry.spec_of(cfg).program(cfg, 4 * 10**6 * 16 + 20_000, DataStep.of(0.1), True)
        return sum(isinstance(op, Transfer) and op.name.startswith("ar") for op in p.ops)
    assert buckets("dense") == 10 and buckets("rows") == 1
