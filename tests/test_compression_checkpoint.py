"""Error feedback in checkpoints (collective/ddp.py, collective/compression.py): a compressed ddp run (ring, N = 2)
checkpointed at step 3 and resumed ends with the uninterrupted run's model, bit for bit: top-k's error feedback
and PowerSGD's (with its Q, the warm start, and its step count against the warm-up) are each rank's own in the
checkpoint; a checkpoint before PowerSGD's first compressed step holds none and the resumed run draws Q from the
same seed. Without the state a resumed run differs (the error of step 3 would be lost), so the test can fail."""
from __future__ import annotations

import pytest
import torch

from collective.ddp import error_key
from parity import OPTIMIZERS, config
from psarch.checkpoint import Checkpoint
from psarch.config import from_dict
from psarch.launch.ranks import run

DDP = {"kind": "ddp", "comm": "ring", "world_size": 2}
CASES = {
    "topk": {"compression": "topk", "topk_ratio": 0.1},
    "powersgd": {"compression": "powersgd", "powersgd_rank": 1, "powersgd_warmup_steps": 1},
    "powersgd-warm": {"compression": "powersgd", "powersgd_rank": 1, "powersgd_warmup_steps": 5},   # past step 3
}


def _train(case: str, **extra):
    return dict(OPTIMIZERS["sgd"], **CASES[case], **extra)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_resumed_compressed_run_is_the_uninterrupted_one(case, tmp_path):
    run(from_dict(config("full", train=_train(case, steps=6), backend=DDP)), tmp_path / "full", echo=False)
    half = _train(case, checkpoint_every=3)
    run(from_dict(config("half", train=dict(half, steps=3), backend=DDP)), tmp_path / "half", echo=False)
    ckpt = Checkpoint(tmp_path / "half" / "checkpoints" / "step_000003")
    try:   # what the checkpoint keeps: each rank's error feedback once compression has begun, else none
        kept = [ckpt.has("head.weight", error_key(r)) for r in range(2)]
        assert kept == [case != "powersgd-warm"] * 2
        if kept[0]:
            numel = ckpt.params["head.weight"]["numel"]
            assert ckpt.read("head.weight", error_key(0), 0, numel).abs().sum() > 0
    finally:
        ckpt.close()
    run(from_dict(config("half", train=dict(half, steps=6), backend=DDP)), tmp_path / "half", echo=False,
        resume=True)
    a = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "half" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), case
