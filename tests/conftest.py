"""Fixtures shared by several test modules."""
from __future__ import annotations

import pytest

from dist_utils import run_ranks
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
