"""DP, one process with one thread per device: ends with `single`'s model (SGD within 1e-5 absolute on every
parameter, parity.SGD_ATOL; AdamW within parity's rtol 1e-4 / atol 1e-5) at N = 2 and 3 on the CPU; its bytes
are the master's copies, counted where they are made and equal to the formula; its memory is the master's
model states plus the replicas'; it runs through `psarch run`; torch.nn.DataParallel, the peer, on CUDA
devices (skipped where fewer than 2 are visible)."""
from __future__ import annotations

import pytest
import torch

from parity import ATOL, OPTIMIZERS, RTOL, SGD_ATOL, assert_same_model, config, model, train
from psarch import theory
from psarch.cli import main
from psarch.config import ConfigError, from_dict, load_config
from psarch.launch.ranks import run
from psarch.workload import build_workload


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    results = {}
    for opt, hp in OPTIMIZERS.items():
        results[f"single-{opt}"] = train(0, 1, config(f"single-{opt}", train=hp), {}, str(out))
        for n in (2, 3):
            name = f"dp-{opt}-{n}"
            results[name] = train(0, 1, config(name, train=hp, backend={"kind": "dp", "world_size": n}), {}, str(out))
    return out, results


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_dp_equals_single(runs, opt, n):
    out, results = runs
    tol = {"rtol": 0, "atol": SGD_ATOL} if opt == "sgd" else {"rtol": RTOL, "atol": ATOL}
    assert_same_model(model(out, f"dp-{opt}-{n}"), model(out, f"single-{opt}"), f"dp N={n} {opt} vs single", **tol)
    for a, b in zip(results[f"dp-{opt}-{n}"]["rows"], results[f"single-{opt}"]["rows"]):
        assert abs(a["loss"] - b["loss"]) < 1e-5   # the master's loss is the global batch's mean


@pytest.mark.parametrize("n", [2, 3])
def test_bytes_are_the_masters_copies(runs, n):
    """Per step: (N - 1) S of parameters out and of gradients in (the formula theory predicts), the N - 1
    shards of the global batch out, one loss in and its gradient out per replica."""
    _, results = runs
    r = results[f"dp-sgd-{n}"]
    cfg = from_dict(config("x", train=OPTIMIZERS["sgd"], backend={"kind": "dp", "world_size": n}))
    s = 4 * r["params"]
    tokens = build_workload(cfg).batch(0, 0, 1)
    inputs = (n - 1) * tokens.numel() * tokens.element_size() // n
    predicted = theory.predict(cfg, r["params"]).link
    assert predicted.sent == predicted.received == (n - 1) * s
    for row in r["rows"]:
        assert row["sent"] == (n - 1) * s + inputs + (n - 1) * 4
        assert row["received"] == (n - 1) * s + (n - 1) * 4
    ops, steps = r["traffic"]["ops"], len(r["rows"])
    assert ops["replicate"]["sent"] == ops["reduce"]["received"] == steps * predicted.sent


@pytest.mark.parametrize("n", [2, 3])
def test_memory_is_the_masters_and_the_replicas(runs, n):
    _, results = runs
    r = results[f"dp-adamw-{n}"]
    cfg = from_dict(config("x", train=OPTIMIZERS["adamw"], backend={"kind": "dp", "world_size": n}))
    predicted, measured = theory.predict(cfg, r["params"]).memory_per_rank, r["memory"]
    assert measured["params"] == measured["grads"] == predicted.params == n * 4 * r["params"]
    # AdamW's two moments; torch keeps its step counter as one more tensor
    assert predicted.optimizer == 8 * r["params"] and 0 <= measured["optimizer"] - predicted.optimizer <= 8


def test_psarch_run_keys_and_compare(tmp_path, capsys):
    assert main(["keys"]) == 0
    kinds = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("backend.kind "))
    assert '"dp"' in kinds and '"torch_dp"' in kinds
    cfg = from_dict(config("dp-run", train=OPTIMIZERS["sgd"], backend={"kind": "dp", "world_size": 2}))
    summary = run(cfg, tmp_path / "dp", echo=False)
    run(from_dict(config("single-run", train=OPTIMIZERS["sgd"])), tmp_path / "single", echo=False)
    assert main(["compare", str(tmp_path / "dp"), str(tmp_path / "single"), "--out", str(tmp_path / "cmp")]) == 0
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert "| dp |" in report and "| single |" in report
    assert summary["label"] == "dp" and summary["world_size"] == 2 and len(summary["memory"]["per_rank"]) == 1
    assert summary["extra"]["devices"] == [["cpu", "cpu"]]
    assert summary["traffic"]["per_rank"][0]["ops"]["replicate"]["calls"] == cfg.train.steps
    assert summary["predicted"]["traffic_per_step"]["worker_sent"] == 4 * summary["params"]


def test_config_refusals():
    with pytest.raises(ConfigError, match=r"train.global_batch = 12: must be divisible by backend.world_size = 5"):
        load_config(None, ['backend.kind="dp"', "backend.world_size=5", "train.global_batch=12"])
    with pytest.raises(ConfigError, match=r'cluster.slow_workers = \[1\]: backend.kind = "dp" runs its workers as threads'):
        load_config(None, ['backend.kind="dp"', "backend.world_size=2", "cluster.slow_workers=[1]"])
    with pytest.raises(ConfigError, match=r'backend.device = "cpu": backend.kind = "torch_dp" is torch.nn.DataParallel'):
        load_config(None, ['backend.kind="torch_dp"', "backend.world_size=2", 'backend.device="cpu"'])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs 2 CUDA devices for torch.nn.DataParallel ({torch.cuda.device_count()} visible)")
@pytest.mark.parametrize("kind", ["dp", "torch_dp"])
def test_on_cuda_devices_equals_single(tmp_path, kind):
    ref = from_dict(config("single-cpu", train=OPTIMIZERS["sgd"], backend={"kind": "single", "device": "cpu"}))
    run(ref, tmp_path / "single", echo=False)
    cfg = from_dict(config(kind, train=OPTIMIZERS["sgd"], backend={"kind": kind, "world_size": 2, "device": "cuda"}))
    summary = run(cfg, tmp_path / kind, echo=False)
    assert_same_model(torch.load(tmp_path / kind / "model.pt", weights_only=True),
                      torch.load(tmp_path / "single" / "model.pt", weights_only=True), f"{kind} on 2 GPUs", rtol=0,
                      atol=SGD_ATOL)
    assert summary["traffic"]["per_rank"][0]["sent_per_step"] >= summary["predicted"]["traffic_per_step"]["worker_sent"]


def test_checkpoints_resume_bit_exact_and_fork_onto_single(tmp_path, capsys):
    """dp writes its master's state as the one process's part: a resume continues bit for bit, and `single`
    forked from the same checkpoint ends with single's model (AdamW, parity's tolerance)."""
    hp, dp = OPTIMIZERS["adamw"], {"kind": "dp", "world_size": 2}
    run(from_dict(config("full", train=hp, backend=dp)), tmp_path / "full", echo=False)
    run(from_dict(config("half", train=dict(hp, checkpoint_every=3, steps=3), backend=dp)), tmp_path / "half",
        echo=False)
    capsys.readouterr()
    run(from_dict(config("half", train=dict(hp, checkpoint_every=3, steps=6), backend=dp)), tmp_path / "half",
        resume=True)
    assert "at step 3" in capsys.readouterr().out
    full, half = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("full", "half"))
    assert all(torch.equal(full[k], half[k]) for k in full)
    run(from_dict(config("single", train=hp)), tmp_path / "single", echo=False)
    run(from_dict(config("fork", train=hp)), tmp_path / "fork", echo=False,
        start=tmp_path / "half" / "checkpoints" / "step_000003")
    assert_same_model(torch.load(tmp_path / "fork" / "model.pt", weights_only=True),
                      torch.load(tmp_path / "single" / "model.pt", weights_only=True), "single forked from dp")
