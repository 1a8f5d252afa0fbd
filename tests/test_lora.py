"""Frozen parameters and LoRA (train.trainable, train.lora_*): the adapter's arithmetic; every backend that trains a
subset ends with `single`'s model when both train the same subset (SGD, within 1e-5 absolute on every parameter,
parity.SGD_ATOL, at N = 2: ddp ring, zero 1-3 on the ring, ps sync, dp, and torch's DDP and
ZeroRedundancyOptimizer); only the parameters that train are reduced (bytes per step from their count, not the
model's) and hold gradients and optimizer state, while the frozen weights are reported apart (ZeRO-3 shards and
all-gathers them too: tests/test_zero3_frozen.py); bad settings stop with one line."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from parity import OPTIMIZERS, SGD_ATOL, assert_same_model, config
from psarch.config import ConfigError, from_dict, load_config
from psarch.launch.ranks import run
from psarch.models.lora import LoRALinear, add_lora
from psarch.report.runs import load_run
from psarch.workload import build_workload
from test_zero3_frozen import frozen_chunks

LORA = dict(OPTIMIZERS["sgd"], lora_rank=2, lora_alpha=4.0)
HEAD_AND_MLP = dict(OPTIMIZERS["sgd"], trainable=["head.weight", "blocks.*.mlp.*"])
N = 2
# name -> (train, backend): each LoRA or frozen run, and the single run it must equal
RUNS = {
    "single-lora": (LORA, {"kind": "single"}),
    "ddp-lora": (LORA, {"kind": "ddp", "comm": "ring", "world_size": N}),
    "ps-lora": (LORA, {"kind": "ps", "mode": "sync", "world_size": N}),
    "dp-lora": (LORA, {"kind": "dp", "world_size": N}),
    "zero1-lora": (LORA, {"kind": "zero", "stage": 1, "comm": "ring", "world_size": N}),
    "zero2-lora": (LORA, {"kind": "zero", "stage": 2, "comm": "ring", "world_size": N}),
    "zero3-lora": (LORA, {"kind": "zero", "stage": 3, "comm": "ring", "world_size": N}),
    "torch_ddp-lora": (LORA, {"kind": "torch_ddp", "world_size": N}),
    "torch_zero-lora": (LORA, {"kind": "torch_zero", "world_size": N}),
    "single-frozen": (HEAD_AND_MLP, {"kind": "single"}),
    "ddp-frozen": (HEAD_AND_MLP, {"kind": "ddp", "comm": "ring", "world_size": N}),
}


def test_lora_linear_is_the_base_plus_the_scaled_low_rank_update():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    layer = LoRALinear(base, rank=2, alpha=4.0, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 6)
    torch.testing.assert_close(layer(x), base(x))   # B starts at zero: the model is unchanged
    assert layer.weight is base.weight and layer.bias is base.bias
    assert layer.lora_A.abs().max() <= 1 / math.sqrt(6) and not layer.lora_A.eq(0).all()
    with torch.no_grad():
        layer.lora_B.normal_()
    expected = x @ base.weight.T + base.bias + 4.0 / 2 * x @ layer.lora_A.T @ layer.lora_B.T
    torch.testing.assert_close(layer(x), expected)


def test_adapters_are_added_where_asked_and_the_rest_frozen():
    cfg = from_dict(config("x", train=dict(LORA, lora_targets=["*.qkv"])))
    trains = {n for n, p in build_workload(cfg).model.named_parameters() if p.requires_grad}
    assert trains == {"blocks.0.attn.qkv.lora_A", "blocks.0.attn.qkv.lora_B"}
    again = dict(build_workload(cfg).model.named_parameters())   # every rank draws the same A
    assert torch.equal(again["blocks.0.attn.qkv.lora_A"], dict(build_workload(cfg).model.named_parameters())[
        "blocks.0.attn.qkv.lora_A"])
    model = nn.Sequential(nn.Linear(2, 2))
    assert add_lora(model, 1, 1.0, ["nothing"], 0) == []


def test_bad_settings_say_what_was_wrong(tmp_path):
    with pytest.raises(ConfigError, match=r"train.lora_targets = \['\*.nothing'\]: no nn.Linear module of the model matches"):
        build_workload(from_dict(config("x", train=dict(LORA, lora_targets=["*.nothing"]))))
    with pytest.raises(ConfigError, match=r"train.trainable: 'nope.\*' names no parameter of the model"):
        build_workload(from_dict(config("x", train={"trainable": ["nope.*"]})))
    with pytest.raises(ConfigError, match=r"train.trainable: 'nope.\*' names no parameter"):   # before any rank
        run(from_dict(config("x", train={"trainable": ["nope.*"]}, backend={"kind": "ddp", "world_size": 2})),
            tmp_path / "x", echo=False)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match=r'train.lora_rank = 2: backend.kind = "torch_dp" trains every parameter'):
        load_config(None, ["train.lora_rank=2", 'backend.kind="torch_dp"', "backend.world_size=2"])
    with pytest.raises(ConfigError, match=r"train.lora_alpha = 8.0: applies only with LoRA adapters; set train.lora_rank > 0"):
        load_config(None, ["train.lora_alpha=8"])
    with pytest.raises(ConfigError, match=r"train.trainable = \[1\]: expected a list of parameter or module names"):
        load_config(None, ["train.trainable=[1]"])
    with pytest.raises(ConfigError, match=r'backend.embeddings = "rows": frozen parameters and LoRA'):
        load_config(None, ["train.lora_rank=2", 'workload.model="dlrm"', 'workload.data="clicks"',
                           'backend.kind="ddp"', 'backend.embeddings="rows"'])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    summaries = {name: run(from_dict(config(name, train=t, backend=b)), out / name, echo=False)
                 for name, (t, b) in RUNS.items()}
    return out, summaries


def _model(out, name):
    return torch.load(out / name / "model.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith("single")])
def test_equals_single_training_the_same_parameters(runs, name):
    out, summaries = runs
    ref = "single-lora" if name.endswith("lora") else "single-frozen"
    assert_same_model(_model(out, name), _model(out, ref), f"{name} vs {ref}", rtol=0, atol=SGD_ATOL)
    initial = build_workload(from_dict(config("x", train=RUNS[name][0]))).model.state_dict()
    trained = _model(out, name)
    for k, v in initial.items():   # frozen weights never move; the adapters and the named parameters do
        moved = not torch.equal(trained[k], v)
        assert moved == (k.endswith(("lora_B", "lora_A")) or (name.endswith("frozen") and (
            k == "head.weight" or ".mlp." in k))), k


# ring passes over S per step: a ring all-reduce is 2, ZeRO-3 adds the backward all-gather, ZeroRedundancyOptimizer
# a broadcast of every shard after DDP's all-reduce
PASSES = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "torch_ddp": 2, "torch_zero": 3}


@pytest.mark.slow
def test_only_the_trainable_parameters_move(runs):
    """Bytes per step from Φ, the parameters that train: ring passes of (N-1)/N · 4Φ (plus at most N - 1
    elements of padding per bucket and pass; torch's peers' bytes are modelled, exactly that), the PS's 4Φ each
    way plus headers, dp's (N - 1) · 4Φ each way plus the scattered inputs and gathered losses. ZeRO-3 also
    all-gathers its chunks of the frozen weights twice (2 (N - 1) chunks each way), and reduce-scatters none."""
    _, s = runs
    for name in RUNS:
        if name.startswith("single"):
            continue
        phi, frozen = s[name]["params"], s[name]["frozen_params"]
        assert phi > 0 and 4 * frozen > 1024   # the frozen weights' bytes would exceed every bound below
        kind = name.rpartition("-")[0]
        frozen_gathers = 2 * (N - 1) * 4 * frozen_chunks(RUNS[name][0], N) if kind == "zero3" else 0
        predicted = s[name]["predicted"]["traffic_per_step"]["worker_sent"] - frozen_gathers
        for t in s[name]["traffic"]["per_rank"]:
            sent = t["sent_per_step"] - frozen_gathers
            if kind in PASSES:
                assert predicted == PASSES[kind] * (N - 1) / N * 4 * phi
                assert predicted <= sent <= predicted + PASSES[kind] * (N - 1) * 4 * 16   # 16 buckets' padding
            elif name.startswith("ps"):
                assert predicted == 4 * phi and predicted < sent <= predicted + 128
            else:
                tokens = build_workload(from_dict(config("x", train=LORA))).batch(0, 0, 1)
                assert predicted == (N - 1) * 4 * phi
                assert sent == predicted + (N - 1) * tokens.numel() * 8 // N + (N - 1) * 4


@pytest.mark.slow
def test_memory_reports_frozen_weights_apart(runs):
    """Memory's `frozen` category is the frozen weights' bytes, predicted and measured: every rank keeps them
    whole but under ZeRO-3, whose ranks keep their chunk of each unit's (tests/test_zero3_frozen.py: at N = 2 and 3);
    gradients and optimizer state are the formulas' for Φ, the parameters that train (SGD with momentum here: no
    AdamW step counters)."""
    _, s = runs
    for name in RUNS:
        phi, frozen = s[name]["params"], s[name]["frozen_params"]
        copies = N if name.startswith("dp") else 1
        predicted = s[name]["predicted"]["memory_per_rank"]
        whole = copies * 4 * frozen if not name.startswith("zero3") else 4 * frozen / N   # N = 2: no padding here
        assert predicted["frozen"] == whole and 0 < predicted["grads"] <= copies * 4 * phi
        for m in s[name]["memory"]["per_rank"]:
            assert m["frozen"] == predicted["frozen"]
            assert (m["params"], m["grads"], m["optimizer"]) == (predicted["params"], predicted["grads"],
                                                                 predicted["optimizer"]), name
            assert m["total"] == m["params"] + m["grads"] + m["optimizer"] + m["buffers"] + m["frozen"]
    out, _ = runs   # psarch compare reads a run folder back with theory as it stands now: the same figures
    assert load_run(out / "ddp-lora")["summary"]["predicted"] == s["ddp-lora"]["predicted"]


def test_resume_with_adapters_is_bit_exact(tmp_path, capsys):
    """A checkpoint holds what trains (the adapters and their optimizer state); the frozen weights come from
    the seed again, so a resumed LoRA run ends where the straight one does, bit for bit."""
    run(from_dict(config("full", train=LORA)), tmp_path / "full", echo=False)
    run(from_dict(config("half", train=dict(LORA, checkpoint_every=3, steps=3))), tmp_path / "half", echo=False)
    capsys.readouterr()
    run(from_dict(config("half", train=dict(LORA, checkpoint_every=3, steps=6))), tmp_path / "half", resume=True)
    assert "at step 3" in capsys.readouterr().out
    a, b = _model(tmp_path, "full"), _model(tmp_path, "half")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
