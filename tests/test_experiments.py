"""Every shipped experiment config loads, and every point of its sweep is a valid config."""
from __future__ import annotations

from pathlib import Path

import pytest

from psarch import load_config
from psarch.launch.sweep import expand, read_sweep

EXPERIMENTS = sorted((Path(__file__).parent.parent / "experiments").glob("*.toml"))


def test_the_experiments_exist():
    names = {p.stem for p in EXPERIMENTS}
    assert {"quickstart", "architectures", "async_convergence", "memory_scaling", "traffic_scaling"} <= names


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_experiment_is_valid(path):
    cfg = load_config(path)
    assert cfg.name == path.stem
    sweep = read_sweep(path)
    if sweep is not None:
        points = expand(path, sweep)
        assert points and not [p.error for p in points if p.error]
