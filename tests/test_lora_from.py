"""LoRA fine-tuning from a trained checkpoint (psarch/checkpoint/finetune.py): `--from` a full run's checkpoint
into a LoRA config starts from its weights (the frozen base equal to the checkpoint's, the adapters' B zero, so
the first loss is the base model's on the same batch), at step 0 with fresh optimizer state; ddp, zero 1-3, dp
and torch's DDP and ZeRO at N = 2 end where `single` does (SGD, parity.SGD_ATOL); a backend without the load
(ps), or a checkpoint of another model, is refused in one line."""
from __future__ import annotations

import json

import pytest
import torch

from parity import OPTIMIZERS, SGD_ATOL, assert_same_model, config
from psarch import registry
from psarch.checkpoint.reader import CheckpointError, consolidated_state_dict
from psarch.config import ConfigError, from_dict
from psarch.launch.ranks import run
from psarch.single_spec import SingleSpec
from psarch.workload import build_workload

LORA = dict(OPTIMIZERS["sgd"], lora_rank=2, lora_alpha=4.0, steps=4)
FROZEN = dict(OPTIMIZERS["sgd"], trainable=["head.weight"], steps=4)   # no adapters: the rest frozen


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A full (no adapters) single run of 3 SGD steps, checkpointed at step 3: the base model's checkpoint."""
    out = tmp_path_factory.mktemp("lorafrom")
    run(from_dict(config("base", train=dict(OPTIMIZERS["sgd"], steps=3, checkpoint_every=3))), out / "base",
        echo=False)
    return out, out / "base" / "checkpoints" / "step_000003"


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name, train", [("lora", LORA), ("frozen", FROZEN)])
def test_fine_tuning_starts_from_the_base_checkpoint(base, name, train):
    out, ckpt = base
    cfg = from_dict(config(name, train=train))
    run(cfg, out / name, echo=False, start=ckpt)
    weights = dict(consolidated_state_dict(ckpt))
    tuned = torch.load(out / name / "model.pt", weights_only=True)
    assert {k for k in tuned if "lora_" not in k} == set(weights)
    for k, w in weights.items():   # frozen: still the checkpoint's, not the seed's
        assert torch.equal(tuned[k], w) or k in train.get("trainable", ()), k
    fresh = build_workload(cfg).model.state_dict()
    assert any(not torch.equal(fresh[n], w) for n, w in weights.items())   # the checkpoint is not the seed's start
    rows = _rows(out / name)
    assert rows[0]["step"] == 0 and len(rows) == train["steps"]   # a new run: step 0
    # the base model with the checkpoint's weights, on the same first batch: B = 0 leaves its loss unchanged
    plain = from_dict(config("plain", train=OPTIMIZERS["sgd"]))
    w = build_workload(plain)
    w.model.load_state_dict(weights)
    with torch.no_grad():
        loss = w.loss_fn(w.model, w.batch(0, *registry.spec_of(plain).batch_shard(plain, 0, 1)))
    assert rows[0]["loss"] == pytest.approx(float(loss), rel=1e-6)
    assert rows[-1]["loss"] != rows[0]["loss"]   # what is trainable trains


BACKENDS = {"ddp": {"kind": "ddp", "comm": "ring"}, **{f"zero{s}": {"kind": "zero", "stage": s, "comm": "ring"}
                                                         for s in (1, 2, 3)},
            "dp": {"kind": "dp"}, "torch_ddp": {"kind": "torch_ddp"}, "torch_zero": {"kind": "torch_zero"}}


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKENDS)
def test_from_the_base_checkpoint_equals_single(base, name):
    out, ckpt = base
    if not (out / "lora" / "model.pt").is_file():
        run(from_dict(config("lora", train=LORA)), out / "lora", echo=False, start=ckpt)
    run(from_dict(config(name, train=LORA, backend=dict(BACKENDS[name], world_size=2))), out / name, echo=False,
        start=ckpt)
    a = torch.load(out / name / "model.pt", weights_only=True)
    b = torch.load(out / "lora" / "model.pt", weights_only=True)
    assert_same_model(a, b, f"{name} vs single from the base checkpoint", rtol=0, atol=SGD_ATOL)


class NoBaseLoad(SingleSpec):
    """A backend that trains subsets but declares no base-weight load (fine_tunes_from_base): a test's backend."""

    kind = "noload"
    fine_tunes_from_base = False


def test_other_backends_and_other_models_are_refused(base):
    out, ckpt = base
    registry.register(NoBaseLoad())
    try:
        other = from_dict(config("p", train=LORA, backend={"kind": "noload"}))
        with pytest.raises(CheckpointError, match=r"loaded on backend.kind = single, ddp, .*ps.* only; 'noload' has no"):
            run(other, out / "p", echo=False, start=ckpt)
    finally:
        registry.unregister("noload")
    other = from_dict(config("o", train=dict(LORA, lora_targets=["*.qkv"]), workload={"gpt": {"n_layer": 1, "n_embd": 8, "n_head": 2}}))
    with pytest.raises(CheckpointError, match=r"parameter .* is not in the checkpoint|has shape"):
        run(other, out / "o", echo=False, start=ckpt)


def test_a_resumed_fine_tune_keeps_the_base_weights(base, tmp_path):
    """Its checkpoints hold only the adapters: the frozen weights come again from the base checkpoint it started
    from, so the resumed run ends where the straight one does, bit for bit."""
    out, ckpt = base
    run(from_dict(config("straight", train=LORA)), tmp_path / "straight", echo=False, start=ckpt)
    half = dict(LORA, checkpoint_every=2)
    run(from_dict(config("half", train=dict(half, steps=2))), tmp_path / "half", echo=False, start=ckpt)
    run(from_dict(config("half", train=half)), tmp_path / "half", echo=False, resume=True)
    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "half" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_fork_of_a_fine_tune_from_a_base_is_refused(base, tmp_path):
    """Its checkpoint holds only the adapters and a fork records it, not the base, as where it started: its frozen
    weights would be drawn from the seed. Refused in one line naming the base; a --resume finds the base again."""
    out, ckpt = base
    run(from_dict(config("tuned", train=dict(LORA, steps=2, checkpoint_every=2))), tmp_path / "tuned", echo=False,
        start=ckpt)
    tuned = tmp_path / "tuned" / "checkpoints" / "step_000002"
    with pytest.raises(ConfigError, match=r"a checkpoint of a fine-tune started from a base model's checkpoint "
                                          r"\(.*step_000003\) holds only what trains"):
        run(from_dict(config("fork", train=LORA)), tmp_path / "fork", echo=False, start=tuned)
