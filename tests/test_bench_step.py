"""psarch.bench.step: psarch's trainers and the hand-written PyTorch loop on one model, in one process."""
from __future__ import annotations

import argparse

import pytest
import torch

from psarch.bench import step as bench_step
from psarch.cluster.device import profile_of
from psarch.cluster.flops import count
from psarch.config import load_config
from psarch.dist import DistContext
from psarch.workload import build_workload

TINY = ["--steps", "4", "--warmup", "1", "--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--batch", "4"]


def test_single_against_the_plain_loop_prints_a_ratio_per_precision(capsys):
    bench_step.main(TINY + ["--backends", "single", "--precision", "fp32,bf16"])
    lines = capsys.readouterr().out.splitlines()
    w = build_workload(load_config(None, [
        "workload.seq_len=16", "workload.gpt.n_layer=1", "workload.gpt.n_embd=32", "workload.gpt.n_head=4",
        "workload.markov.vocab_size=256", "train.global_batch=4"]))
    params = sum(p.numel() for p in w.model.parameters())
    fc = count(w.model, w.loss_fn, w.batch(0, 0, 1))
    assert lines[0].startswith(f"{params / 1e6:.2f}M-parameter GPT"), lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("fp32", "single", "plain", "loop"),
                                                        ("bf16", "single", "plain", "loop")]
    for r in rows:
        mine, peer, ratio = float(r[4]), float(r[5]), float(r[6])
        assert mine > 0 and peer > 0 and ratio == pytest.approx(mine / peer, rel=0.01, abs=0.002)
        # the rate is the step's model FLOPs (forward and backward) over psarch's time; no MFU without a GPU
        # profile to hold it against
        assert float(r[7]) == pytest.approx((fc.forward + fc.backward) / (mine / 1e3) / 1e12, rel=0.01, abs=2e-3)
        assert r[8] == "-"


def test_a_gpu_is_known_by_its_profile_name():
    assert profile_of("NVIDIA H100 80GB HBM3") == "h100"
    assert profile_of("NVIDIA A100-SXM4-40GB") == "a100"
    assert profile_of("Tesla V100-SXM2-16GB") == "v100"
    assert profile_of("NVIDIA GeForce RTX 4090") is None


def test_the_plain_peer_trains_the_same_model_as_psarch_single():
    """The peer is a fair one: in fp32 its first steps move the model as psarch's single backend does."""
    args = argparse.Namespace(steps=3, batch=4, seq_len=16, n_layer=1, n_embd=32)
    cfg = bench_step.bench_config(args, "single", "fp32")
    w = build_workload(cfg)
    peer_model = w.model
    opt = bench_step.adamw(peer_model.parameters(), cfg)
    step = bench_step.plain_step(peer_model, w.loss_fn, opt, "fp32", torch.device("cpu"))
    mine = bench_step.psarch_runner("single", cfg, DistContext(0, 1, 0, torch.device("cpu")))
    for s in range(3):
        batch = w.batch(s, 0, 1)
        assert mine(batch) == pytest.approx(step(batch), rel=1e-5)   # step 0 alike; later ones: same updates


@pytest.mark.parametrize("argv,message", [(["--backends", "single,horovod"], "--backends 'single,horovod'"),
                                          (["--precision", "fp16"], "--precision 'fp16'"),
                                          (["--steps", "3", "--warmup", "3"], "--steps 3 must exceed --warmup 3")])
def test_bad_arguments_are_refused_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench_step.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", [["-m", "psarch.bench_step"], ["-m", "psarch.cli", "bench", "step"],
                                     ["-m", "psarch.bench", "step"]])
def test_the_documented_entry_and_the_bench_command_are_one_benchmark(command, capsys, monkeypatch):
    """`python -m psarch.bench_step` (the entry the GPU instructions name), `psarch bench step` and
    `python -m psarch.bench step` run the same benchmark. Each module run as `-m` runs it (runpy, as __main__), in this
    process: an interpreter and torch's import saved a call."""
    import runpy
    import sys
    import warnings

    module, args = command[1], command[2:]
    monkeypatch.setattr(sys, "argv", [module, *args, "--help"])
    capsys.readouterr()
    with warnings.catch_warnings(), pytest.raises(SystemExit) as e:
        warnings.simplefilter("ignore", RuntimeWarning)   # the module is imported already: runpy says so
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    out = capsys.readouterr()
    assert e.value.code in (0, None), out.err
    assert out.out.startswith("usage: psarch bench step"), out.out
