"""Fixtures shared by several test modules."""
from __future__ import annotations

import threading

import pytest
import zmq

from psarch.config import from_dict
from psarch.ps import auth
from psarch.ps.auth import Credentials
from psarch.ps.layout import initial_flat
from psarch.ps.server.parameter_server import ParameterServer
from psarch.ps.services import start_services
from psarch.workload import build_workload
from dist_utils import run_ranks
from ps_setup import Raw, config as ps_config, pressure_config, ps
from zero_runs import OPTIMIZERS, all_variants, config, train
from timing import scaled


@pytest.fixture(scope="session")
def zero_runs(tmp_path_factory):
    """Every ZeRO variant at N = 2 and 3 in one process group each, plus the single references: the runs
    test_zero.py (parity) and test_zero_books.py (memory, traffic) check. Start-up is the expensive part."""
    out = tmp_path_factory.mktemp("zero")
    for opt, hp in OPTIMIZERS.items():
        train(0, 1, config(f"single-{opt}", train=hp), str(out))
    results = {}
    for n in (2, 3):
        for rank, res in enumerate(run_ranks(all_variants, n, str(out), timeout=scaled(300))):
            for name, r in res.items():
                results.setdefault(name, {})[rank] = r
    return out, results


@pytest.fixture
def server():
    """server(mode, precision, workers, servers, **backend) -> (services, numel): PS servers in threads of this
    process (test_ps_server.py, test_ps_round_order.py, test_replication.py); everything stopped after."""
    started, zctx = [], zmq.Context()

    def make(mode: str, precision: str = "fp32", workers: int = 2, servers: int = 1, **extra):
        cfg = from_dict(ps_config("srv", train={"optimizer": "sgd", "lr": 0.5, "precision": precision},
                                  workload={"model": "mlp"}, backend=ps(workers, mode, servers, **extra)))
        started.append(start_services(cfg, None, threads=True))
        return started[-1], sum(p.numel() for p in build_workload(cfg).model.parameters())

    # a raw peer authenticated as `worker` with the last started servers' credentials
    make.raw = lambda address, worker=0: Raw(zctx, address, started[-1].info.auth if started else None, worker)
    yield make
    for s in started:
        s.stop()
    zctx.destroy(linger=0)


@pytest.fixture
def serve(tmp_path):
    """serve(mode, optimizer, **backend) -> server: a ParameterServer thread (PLAIN, keys in tmp_path), for
    test_ps_pressure*.py (test_ps_auth.py and test_ps_lockout.py declare their own)."""
    started, keys = [], auth.keygen(tmp_path / "keys", 2, 1)

    def make(mode: str = "async", optimizer: str = "sgd", **backend) -> ParameterServer:
        cfg = pressure_config(mode, optimizer, keys=str(keys), **backend)
        flat = initial_flat(cfg)
        srv = ParameterServer(0, cfg, creds=Credentials("plain", str(keys)), numel=flat.numel())
        srv.initialize(flat)
        thread = threading.Thread(target=srv.serve, daemon=True)
        thread.start()
        started.append((srv, thread))
        return srv

    yield make
    for srv, thread in started:
        srv.stop()
        thread.join(5)
