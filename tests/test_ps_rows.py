"""The parameter server's embedding rows (backend.embeddings = "rows"): parity with `single`, traffic and memory.

Sync PS with rows, with SGD and with Adagrad (both equal the dense update: an untouched row's gradient is
exactly zero), at N = 2 and 3 with 2 servers, ends with the model of `single` within tests/parity.py's
tolerances. The workload is small (2 tables x 1000 rows x dim 8, Zipf 1.05): a batch of a few dozen
samples touches a few percent of the rows, so a worker's embedding bytes stay far below the table's.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from parity import ATOL, assert_same_model, config, model, train
from psarch import theory
from psarch.config import from_dict
from psarch.ps.services import start_services
from psarch.workload import build_workload

ROWS_DLRM = {
    "seed": 5,
    "workload": {"model": "dlrm", "data": "clicks",
                 "dlrm": {"num_tables": 2, "rows": 1000, "dim": 8, "bag": 2, "bottom_mlp": [8], "top_mlp": [8]},
                 "clicks": {"zipf": 1.05, "dense": 4}},
    "train": {"steps": 5, "global_batch": 24, "log_every": 100},
}
OPTIMIZERS = {"sgd": {"optimizer": "sgd", "lr": 0.5},
              "adagrad": {"optimizer": "adagrad", "lr": 0.1, "eps": 1e-6, "initial_accumulator_value": 0.1}}
SIZES = (2, 3)
HEADER_BOUND = 128     # bytes of one message's header frame, at most (test_ps.py)


def _data(name: str, opt: str, n: int = 1, **backend) -> dict:
    b = {"kind": "single"} if n == 1 else dict({"kind": "ps", "mode": "sync", "servers": 2, "timeout_s": 60.0,
                                                "embeddings": "rows"}, **backend)
    return config(name, base=ROWS_DLRM, train=OPTIMIZERS[opt], backend=dict(b, world_size=n))


def _plan(n: int) -> dict[str, dict]:
    return {f"rows-{opt}-{n}": _data(f"rows-{opt}-{n}", opt, n) for opt in OPTIMIZERS}


def _variants(rank: int, n: int, out: str, runs: dict, infos: dict) -> dict:
    return {name: train(rank, n, data, infos[name], out) for name, data in runs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("ps_rows")
    for opt in OPTIMIZERS:
        train(0, 1, _data(f"single-{opt}", opt), {}, str(out))
    results, servers = {}, {}
    for n in SIZES:
        plan = _plan(n)
        services = {name: start_services(from_dict(d), None, threads=True) for name, d in plan.items()}
        try:
            res = run_ranks(_variants, n, str(out), plan, {k: s.info for k, s in services.items()}, timeout=300)
            for name, s in services.items():
                servers[name] = s.finish()
        finally:
            for s in services.values():
                s.stop()
        for name in plan:
            results[name] = [r[name] for r in res]
    return out, results, servers


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_sync_rows_equal_single(runs, opt, n):
    out, _, _ = runs
    ref = model(out, f"single-{opt}")
    init = build_workload(from_dict(ROWS_DLRM)).model.state_dict()
    assert max((ref[k] - v).abs().max().item() for k, v in init.items()) > 100 * ATOL, "reference barely trained"
    assert_same_model(model(out, f"rows-{opt}-{n}"), ref, f"ps rows {opt} N={n} vs single")
