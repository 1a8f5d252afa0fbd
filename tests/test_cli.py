"""End to end: `python -m psarch.cli run` on a tiny config, its run folder checked; a factory next to the config;
the progress line (config errors, a failing rank and unforeseen errors: tests/test_cli_errors.py).

Every run is a subprocess with PSARCH_THREADS=1; the whole file takes well under a minute on 2 cores."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from psarch.config import from_dict, load_config
from psarch.workload import build_workload
from timing import scaled
from tiny import tiny

TINY = tiny()

ENV = dict(os.environ, PSARCH_THREADS="1")
ENV.pop("PSARCH_DEBUG", None)
for _k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # never look launched by torchrun
    ENV.pop(_k, None)


def cli_args(*args: str) -> list[str]:
    return [sys.executable, "-m", "psarch.cli", *args]


def psarch(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cli_args(*args), cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


# step, the interval's mean loss, gap to the entropy floor, throughput and what it is (psarch/throughput.py), bytes
# sent per step (then skipped steps, loss scale)
PROGRESS = re.compile(r"^step\s+\d+/\d+\s+\d+-step mean loss\s+\d+\.\d{4}\s+gap\s+-?\d+\.\d{4}\s+\d+\.\d\s+samples/s"
                      r" \((global batch / median step time|rank 0's shard / its median step time)\)"
                      r"\s+\d+(\.\d\d)?\s(B|KiB|MiB|GiB)/step sent(\s+skipped \d+)?(\s+scale \S+)?$")


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- (a) single

@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("single")
    (cwd / "tiny.toml").write_text(TINY)
    proc = psarch(cwd, "run", "tiny.toml")  # default run folder: runs/<config stem>
    return cwd, proc


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("ddp")
    (cwd / "tiny.toml").write_text(TINY)
    proc = psarch(cwd, "run", "tiny.toml", "--set", "backend.kind=ddp", "--set", "backend.world_size=2",
                  "--set", "backend.comm=ring", "--set", "name=tiny_ddp", "--out", "out/ddp")
    return cwd, proc


SUMMARY_FIELDS = ("name", "backend", "variant", "world_size", "servers", "params", "steps", "global_batch",
                  "final_loss", "step_time_s", "samples_per_s", "memory", "traffic")


def check_run_folder(run_dir: Path, cfg_path: Path, overrides: list[str], backend: str, world: int) -> dict:
    for f in ("config.json", "metrics.jsonl", "summary.json", "model.pt", "report.txt"):
        assert (run_dir / f).is_file(), f"{f} missing from {run_dir}"
    # config.json is the resolved config, and round-trips through from_dict
    data = json.loads((run_dir / "config.json").read_text())
    cfg = from_dict(data)
    assert cfg == load_config(cfg_path, overrides)
    assert cfg.backend.kind == backend and cfg.backend.world_size == world
    # metrics: one row per step, finite losses
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert all(r["step_time_s"] > 0 for r in rows)
    # summary: every field the design lists
    s = json.loads((run_dir / "summary.json").read_text())
    for k in SUMMARY_FIELDS:
        assert k in s, f"summary.json lacks {k}"
    assert s["name"] == cfg.name and s["backend"] == backend and s["world_size"] == world
    assert s["steps"] == 6 and s["global_batch"] == 4 and s["servers"] == 0
    assert s["final_loss"] == rows[-1]["loss"]
    assert s["step_time_s"] > 0 and s["samples_per_s"] == pytest.approx(4 / s["step_time_s"])
    assert len(s["memory"]["per_rank"]) == world and len(s["traffic"]["per_rank"]) == world
    phi = s["params"]
    for m in s["memory"]["per_rank"]:
        for k in ("params", "grads", "optimizer", "total", "peak"):
            assert k in m, f"memory.per_rank lacks {k}"
        assert m["params"] == 4 * phi and m["grads"] == 4 * phi       # fp32, replicated
        assert 8 * phi <= m["optimizer"] <= 8 * phi + 4 * 64           # Adam moments (+ step counters)
        assert m["total"] >= m["params"] + m["grads"] + m["optimizer"]
        assert m["peak"] > 0
    for t in s["traffic"]["per_rank"]:
        assert "sent" in t and "received" in t
    # model.pt: the consolidated fp32 state_dict, loadable by the plain model built from the same config
    state = torch.load(run_dir / "model.pt", weights_only=True)
    model = build_workload(cfg).model
    ref = {k: v.clone() for k, v in model.state_dict().items()}  # the initial model
    assert set(state) == set(ref)
    assert all(state[k].shape == ref[k].shape and state[k].dtype == torch.float32 for k in ref)
    model.load_state_dict(state)  # strict
    assert phi == sum(p.numel() for p in model.parameters())
    assert any(not torch.equal(state[k], ref[k]) for k in ref), "model.pt is the initial model: no training?"
    report = (run_dir / "report.txt").read_text()
    assert cfg.name in report and backend in report and f"{phi:,}" in report
    return s


def test_single_run_end_to_end(single_run):
    cwd, proc = single_run
    assert proc.returncode == 0, proc.stderr
    progress = [line for line in proc.stdout.splitlines() if PROGRESS.match(line)]
    assert len(progress) == 3, proc.stdout                          # log_every = 2, 6 steps
    for line, step in zip(progress, (2, 4, 6)):
        assert f"{step}/6" in line and "loss" in line
    s = check_run_folder(cwd / "runs" / "tiny", cwd / "tiny.toml", [], "single", 1)
    assert s["variant"] == ""
    assert s["traffic"]["per_rank"][0]["sent"] == 0 and s["traffic"]["per_rank"][0]["received"] == 0
    assert s["entropy_floor"] is not None and s["gap"] == pytest.approx(s["final_loss"] - s["entropy_floor"])


def test_ddp_run_end_to_end(ddp_run, single_run):
    cwd, proc = ddp_run
    assert proc.returncode == 0, proc.stderr
    assert sum(bool(PROGRESS.match(line)) for line in proc.stdout.splitlines()) == 3, proc.stdout  # rank 0 only
    run_dir = cwd / "out" / "ddp"
    overrides = ["backend.kind=ddp", "backend.world_size=2", "backend.comm=ring", "name=tiny_ddp"]
    s = check_run_folder(run_dir, cwd / "tiny.toml", overrides, "ddp", 2)
    assert s["variant"] == "ring"
    rows = rows_of(run_dir)
    # consistency: a step's loss is the mean of its workers'; the summary's final loss is the last row's
    for r in rows:
        assert len(r["workers"]) == 2
        assert r["loss"] == pytest.approx(sum(w["loss"] for w in r["workers"]) / 2, rel=1e-12)
    assert s["final_loss"] == rows[-1]["loss"]

    # traffic: each rank sends (and receives) 2(N-1)/N * S per step, S = params * 4 bytes. The ring pads each
    # bucket to N chunks of ceil(len/N) elements, so it may move up to 2(N-1)/N * (N-1) * 4 < N * 4 bytes more
    # per bucket: slack = N * 4 * num_buckets (num_buckets from the DDP bucket rule at bucket_cap_mb).
    from collective.bucket import assign_buckets

    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    n, phi = 2, s["params"]
    params = [p for p in build_workload(cfg).model.parameters()][::-1]
    offsets = [0]
    for p in params[:-1]:
        offsets.append(offsets[-1] + p.numel())
    num_buckets = len(assign_buckets(params, offsets, cfg.backend.bucket_cap_mb * 2**20))
    expected = 2 * (n - 1) / n * phi * 4
    slack = n * 4 * num_buckets
    for t in s["traffic"]["per_rank"]:
        assert t["modelled"] is False                                  # the ring counts its own bytes
        assert expected <= t["sent_per_step"] <= expected + slack, (t, expected, slack)
        assert expected <= t["received_per_step"] <= expected + slack, (t, expected, slack)
    for r in rows:
        for w in r["workers"]:
            assert expected <= w["sent"] <= expected + slack
    assert s["predicted"]["traffic_per_step"]["worker_sent"] == pytest.approx(expected)

    # same data, same initial model: DDP at N=2 ends where the single backend ends (summation order aside)
    scwd, sproc = single_run
    assert sproc.returncode == 0, sproc.stderr
    a = torch.load(run_dir / "model.pt", weights_only=True)
    b = torch.load(scwd / "runs" / "tiny" / "model.pt", weights_only=True)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    single_rows = rows_of(scwd / "runs" / "tiny")
    for r, q in zip(rows, single_rows):
        assert r["loss"] == pytest.approx(q["loss"], rel=1e-4)


# ---------------------------------------------------------------- a factory next to the config

CWD_FACTORY = textwrap.dedent('''
    import torch
    from psarch import Workload

    def make(cfg):
        def batch(step, shard, num_shards):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
            per = 4 // num_shards
            return x[shard * per:(shard + 1) * per]
        return Workload(torch.nn.Linear(3, 1), lambda model, x: model(x).pow(2).mean(), batch, name="cwd")

    def broken(cfg):
        wl = make(cfg)
        return Workload(wl.model, lambda model, x: {}["no such key"], wl.batch, name="broken")
''')


@pytest.mark.parametrize("backend", [["backend.kind=single"], ["backend.kind=ddp", "backend.world_size=2"]])
def test_console_script_imports_a_factory_from_the_working_directory(tmp_path, backend):
    """The `psarch` script's sys.path[0] is its bin folder; the factory module sits in the working
    directory, as it does for `python -m psarch.cli`. Spawned ranks (ddp) must import it too."""
    script = shutil.which("psarch")
    assert script, "the psarch console script is not installed"
    (tmp_path / "my_cwd_factory.py").write_text(CWD_FACTORY)
    (tmp_path / "tiny.toml").write_text(TINY)
    args = [script, "run", "tiny.toml", "--quiet", "--out", "out", "--set", "workload.factory=my_cwd_factory:make"]
    for o in backend:
        args += ["--set", o]
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["workload"] == "cwd"


def test_progress_line_counts_skipped_steps(capsys):
    """fp16 overflow at steps 3 and 4 (rows 3, 4): the intervals ending at steps 4 and 6 each skipped one."""
    from psarch.dist import DistContext
    from psarch.launch.runner import run_rank

    cfg = from_dict({"workload": {"factory": "factories:overflow_at_steps_3_and_4"},
                     "train": {"steps": 6, "global_batch": 8, "optimizer": "sgd", "lr": 0.05, "precision": "fp16",
                               "log_every": 2}})
    run_rank(cfg, DistContext(), echo=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(PROGRESS.match(line) for line in lines), lines
    assert ["skipped" in line for line in lines] == [False, True, True], lines
    assert all(re.search(r"/step sent  skipped 1  scale \d+$", line) for line in lines[1:]), lines
