"""Every shipped experiment config loads, and every point of its sweep is a valid config; every study folder
has its README."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from psarch import load_config
from psarch.launch.sweep import expand, read_sweep

ROOT = Path(__file__).parent.parent / "experiments"
EXPERIMENTS = sorted(ROOT.rglob("*.toml"), key=lambda p: p.relative_to(ROOT).parts)
STUDIES = sorted(p for p in ROOT.iterdir() if p.is_dir())


@pytest.fixture(scope="module", autouse=True)
def one_preflight():
    """check_machine asks, once a sweep with cluster.emulate, whether this machine can emulate: the real probe
    (13 commands: a scratch namespace, its veth and its shaper) answers once here, its answer given to every
    experiment (the machine does not change between them)."""
    import functools

    import psarch.cluster.preflight as preflight

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(preflight, "missing", functools.cache(preflight.missing))
        yield


def test_the_experiments_exist():
    names = {p.stem for p in EXPERIMENTS}
    assert {"quickstart", "architectures", "async_convergence", "memory_scaling", "traffic_scaling"} <= names


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_every_study_folder_says_what_it_asks_and_how_to_run_it(study):
    readme = (study / "README.md").read_text()
    commands = re.findall(r"^\s*(?:psarch|python|PSARCH_THREADS=1 python) \S+", readme, re.M)
    assert readme.startswith("# ") and commands, f"{study}/README.md: a title and the command that makes it"
    for link in re.findall(r"\]\(([^)#:]+)\)", readme):          # relative links resolve
        assert (study / link).exists(), f"{study.name}/README.md links to {link}, which is not there"


def test_no_result_folder_keeps_history_by_name():
    old = [p for p in ROOT.rglob("*") if p.is_dir() and p.name.startswith(("before_", "old_"))]
    assert not old


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: "/".join(p.relative_to(ROOT).parts))
def test_experiment_is_valid(path):
    cfg = load_config(path)
    if re.search(r"^name = ", path.read_text(), re.M):      # a config that names its runs, names its file
        assert cfg.name == path.stem
    sweep = read_sweep(path)
    if sweep is not None:
        points = expand(path, sweep)
        assert points and not [p.error for p in points if p.error]
