"""A ZeRO-3 LoRA run (train.lora_rank; its frozen base weights sharded with their units, zero/frozen.py) resumed from
its step-3 checkpoint (`--resume`) ends with the uninterrupted run's model, bit for bit, and logs the same losses for
steps 4-6: the checkpoint holds each rank's chunks of the adapters and their SGD momentum, the base weights come from
the seed again. Both runs in one spawned process group (N = 2, two blocks, so three units are gathered one by one).

Not vacuous: the checkpoint holds the adapters' momentum (a resumed run without it would step differently: SGD with
momentum 0.9), and none of the frozen base weights (what trains only)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint_runs import ROW_KEYS, ZERO, _run
from dist_utils import run_ranks
from parity import OPTIMIZERS, config
from psarch.checkpoint import Checkpoint
from timing import scaled

LORA = dict(OPTIMIZERS["sgd"], lora_rank=2, lora_alpha=4.0)
N = 2


def lora_config(name: str, **train) -> dict:
    return config(name, workload={"gpt": {"n_layer": 2, "n_embd": 16, "n_head": 2}},
                  train=dict(LORA, **train), backend=dict(ZERO, stage=3, world_size=N))


def straight_and_resumed(rank: int, n: int, out: str) -> dict:
    """6 steps straight with a checkpoint every 3; then, from the step-3 checkpoint, resumed to step 6 (its records
    of steps 1-3 carried from the checkpoint, step times included)."""
    o, keys = Path(out), (*ROW_KEYS, "step_time_s")
    straight = _run(rank, n, lora_config("straight", steps=6, checkpoint_every=3), o, o / "checkpoints", keys=keys)
    resumed = _run(rank, n, lora_config("resumed", steps=6), o, start=o / "checkpoints" / "step_000003", resume=True,
                   keys=keys)
    return {"straight": straight["rows"], "resumed": resumed["rows"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3-lora-resume")
    return out, run_ranks(straight_and_resumed, N, str(out), timeout=scaled(300))


def test_a_resumed_zero3_lora_run_is_the_uninterrupted_one(runs):
    out, ranks = runs
    a, b = (torch.load(out / f"{name}.pt", weights_only=True) for name in ("straight", "resumed"))
    assert a.keys() == b.keys() and any("lora" in k for k in a)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"resumed differs from straight in {differ}"
    for rank, rows in enumerate(ranks):
        straight, resumed = rows["straight"], rows["resumed"]
        assert [r["step"] for r in resumed] == list(range(6)), rank
        assert resumed[:3] == straight[:3], rank   # carried whole: the first 3 steps were not run again
        untimed = [[{k: v for k, v in r.items() if k != "step_time_s"} for r in x[3:]] for x in (straight, resumed)]
        assert untimed[0] == untimed[1], rank   # steps 4-6: the same losses
        assert [r["step_time_s"] for r in resumed[3:]] != [r["step_time_s"] for r in straight[3:]], rank


def test_the_checkpoint_holds_the_adapters_momentum_and_no_base_weight(runs):
    out, _ = runs
    ckpt = Checkpoint(out / "checkpoints" / "step_000003")
    try:
        names = list(ckpt.params)
        assert names and all("lora" in k for k in names), names
        keys = {k for name in names for k in ("momentum_buffer",) if ckpt.has(name, k)}
        assert keys == {"momentum_buffer"}
        held = ckpt.read(names[0], "momentum_buffer", 0, ckpt.numel(names[0], "momentum_buffer"))
        assert held.abs().sum() > 0
    finally:
        ckpt.close()
