"""The hybrid (backend.embeddings = "ps": the tables on PS servers, the dense part on ddp or ZeRO) fine-tuning `--from`
a base model's checkpoint (psarch/checkpoint/finetune.py): the ranks load the dense base weights into their models,
each server its shard of the tables' rows (psarch/ps/server/start.py's table_server), the row optimizer fresh. LoRA
adapters on the dense layers with the tables training on the servers end where `single`'s fine-tune from the same
checkpoint does (SGD, parity.SGD_ATOL), at N = 2 with 2 servers, and its own checkpoints (the servers' rows beside the
ranks' adapters) resume to the same model, bit for bit, the frozen weights read again from the base. A fine-tune's
checkpoint from the seed forks onto the hybrid as onto `single`; a fork of a fine-tune started from a base is refused
(it holds only what trains)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from parity import SGD_ATOL, assert_same_model, config
from psarch.checkpoint.reader import consolidated_state_dict
from psarch.config import ConfigError, from_dict
from psarch.launch.ranks import run
from psarch.workload import build_workload
from test_ps_rows import ROWS_DLRM

SGD = dict(optimizer="sgd", lr=0.5, momentum=0.0, weight_decay=0.0)
LORA = dict(SGD, lora_rank=2, lora_alpha=4.0, trainable=["tables.*"])   # the tables train on the PS servers
HYBRIDS = {"ddp": {"kind": "ddp", "comm": "ring"}, "zero3": {"kind": "zero", "stage": 3, "comm": "ring"}}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A full single DLRM run of 3 SGD steps, checkpointed at step 3, and `single`'s LoRA fine-tune from it."""
    out = tmp_path_factory.mktemp("hybridfrom")
    run(from_dict(config("base", base=ROWS_DLRM, train=dict(SGD, steps=3, checkpoint_every=3))), out / "base",
        echo=False)
    ckpt = out / "base" / "checkpoints" / "step_000003"
    run(from_dict(config("single", base=ROWS_DLRM, train=LORA)), out / "single", echo=False, start=ckpt)
    return out, ckpt


@pytest.fixture(scope="module")
def hybrid(base):
    """Each hybrid's fine-tune from the base checkpoint (a checkpoint every 2 steps), run once when first asked for."""
    out, ckpt = base
    done: set[str] = set()

    def get(name: str):
        if name not in done:
            run(_hybrid(name), out / name, echo=False, start=ckpt)
            done.add(name)
        return out / name
    return get


def _hybrid(name: str):
    backend = dict(HYBRIDS[name], embeddings="ps", servers=2, world_size=2)
    return from_dict(config(name, base=ROWS_DLRM, train=dict(LORA, checkpoint_every=2), backend=backend))


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_from_the_base_checkpoint_equals_single(base, hybrid, name):
    out, ckpt = base
    cfg = _hybrid(name)
    hybrid(name)
    a = torch.load(out / name / "model.pt", weights_only=True)
    b = torch.load(out / "single" / "model.pt", weights_only=True)
    assert_same_model(a, b, f"hybrid {name} vs single from the base checkpoint", rtol=0, atol=SGD_ATOL)
    print(f"hybrid {name}: max |hybrid - single| = {max(float((a[k] - b[k]).abs().max()) for k in a):.3g}")
    weights = dict(consolidated_state_dict(ckpt))
    model = build_workload(cfg, device="meta").model
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(torch.equal(a[k], weights[k]) for k in frozen)   # the dense base: the checkpoint's
    # B = 0: each rank's first loss is the base model's (its dense part and the tables' rows the checkpoint's)
    plain = build_workload(from_dict(config("plain", base=ROWS_DLRM, train=SGD)))
    plain.model.load_state_dict(weights)
    for r in range(2):
        first = json.loads((out / name / "ranks" / f"rank{r}.jsonl").read_text().splitlines()[0])
        with torch.no_grad():
            expected = float(plain.loss_fn(plain.model, plain.batch(0, r, 2)))
        assert first["step"] == 0 and first["loss"] == pytest.approx(expected, rel=1e-6)


def test_a_resumed_fine_tune_from_the_base_ends_with_the_straight_model(base, hybrid, tmp_path):
    """From its step-2 checkpoint (the adapters, the servers' rows): the frozen dense weights read again from the
    base, the rows from the checkpoint, to the straight fine-tune's model.pt, bit for bit."""
    straight = hybrid("ddp")
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    run(_hybrid("ddp"), resumed, echo=False, resume=True, pick="2")
    a = torch.load(resumed / "model.pt", weights_only=True)
    b = torch.load(straight / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_fine_tunes_checkpoint_from_the_seed_forks_onto_the_hybrid(base, hybrid, tmp_path):
    """A fine-tune from the seed holds what trains (adapters, tables) and draws the rest from the seed, as the fork
    does: the hybrid from its step-2 checkpoint ends where `single` from it does; a fork of a fine-tune that started
    from a base is refused (it would draw the frozen weights from the seed, not the base)."""
    lora = from_dict(config("lora", base=ROWS_DLRM, train=dict(LORA, steps=2, checkpoint_every=2)))
    run(lora, tmp_path / "lora", echo=False)
    ckpt = tmp_path / "lora" / "checkpoints" / "step_000002"
    run(from_dict(config("single", base=ROWS_DLRM, train=LORA)), tmp_path / "single", echo=False, start=ckpt)
    run(_hybrid("ddp"), tmp_path / "h", echo=False, start=ckpt)
    a = torch.load(tmp_path / "h" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "single" / "model.pt", weights_only=True)
    assert_same_model(a, b, "hybrid vs single from a fine-tune's checkpoint", rtol=0, atol=SGD_ATOL)
    with pytest.raises(ConfigError, match=r"^--from .*: a checkpoint of a fine-tune started from a base model's "
                                          r"checkpoint .* holds only what trains") as e:
        run(_hybrid("ddp"), tmp_path / "again", echo=False, start=hybrid("ddp") / "checkpoints" / "step_000002")
    assert "\n" not in str(e.value)
