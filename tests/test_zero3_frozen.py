"""ZeRO-3 shards the frozen weights (train.trainable, LoRA's base) as it shards those that train (zero/frozen.py).

Each rank keeps its chunk of every unit's frozen weights: Σ_u ceil(F_u / N) elements, F_u the frozen parameters of
unit u (each block of model.blocks, and the root holding the rest), counted here from the model itself. Memory's
`frozen` category measures exactly that on every rank, and theory predicts it, at N = 2 and 3; they are all-gathered
with their unit in forward and again in backward (2 (N - 1) chunks sent per rank and step, on the ring's own count)
and never reduce-scattered, while the parameters that train move as before. The model equals `single`'s (SGD,
parity.SGD_ATOL = 1e-5 absolute) with LoRA on two blocks (the second block's base weights are read by its backward
after its adapters' gradients are reduced: freeing them then fails the run) and with a block frozen whole between
a block and a head that train, and with LoRA on the last block only (the first, frozen whole before anything that
trains, is never reached by backward: gathered in forward only)."""
from __future__ import annotations

import pytest
import torch

from parity import OPTIMIZERS, SGD_ATOL, TINY_GPT, assert_same_model, config
from psarch.config import from_dict
from psarch.launch.ranks import run
from psarch.workload import build_workload

GPT2 = {"gpt": {"n_layer": 2, "n_embd": 16, "n_head": 2}}
LORA = dict(OPTIMIZERS["sgd"], lora_rank=2, lora_alpha=4.0)
BLOCK0 = dict(OPTIMIZERS["sgd"], trainable=["blocks.0.*", "head.weight"])   # block 1 frozen whole
LATE = dict(LORA, lora_targets=["blocks.1.*"])   # block 0 frozen whole and before all that trains: backward never in it
ZERO3 = {"kind": "zero", "stage": 3, "comm": "ring"}
# name -> (train, world size; None: single)
RUNS = {"single-lora": (LORA, None), "single-block0": (BLOCK0, None), "single-late": (LATE, None),
        "zero3-lora-2": (LORA, 2), "zero3-lora-3": (LORA, 3), "zero3-block0-3": (BLOCK0, 3), "zero3-late-2": (LATE, 2)}


def _config(name: str, train: dict, n: int | None):
    backend = {"kind": "single"} if n is None else dict(ZERO3, world_size=n)
    return from_dict(config(name, train=train, backend=backend, workload=GPT2))


def frozen_chunks(train: dict, n: int, workload: dict = TINY_GPT["workload"], reached_only: bool = False) -> int:
    """Frozen elements one ZeRO-3 rank keeps, from the model: ceil(F_u / N) for each unit u holding F_u > 0;
    reached_only: of the root and the blocks from the first that trains on (the embeddings train in no run here)."""
    model = build_workload(from_dict(config("x", train=train, workload=workload))).model
    blocks = [sum(p.numel() for p in b.parameters() if not p.requires_grad) for b in model.blocks]
    trains = [any(p.requires_grad for p in b.parameters()) for b in model.blocks] + [True]
    root = sum(p.numel() for p in model.parameters() if not p.requires_grad) - sum(blocks)
    return sum(-(-f // n) for f in [root, *blocks[trains.index(True) if reached_only else 0:]])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3frozen")
    return out, {name: run(_config(name, train, n), out / name, echo=False) for name, (train, n) in RUNS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if n.startswith("zero3")])
def test_equals_single(runs, name):
    out, _ = runs
    ref = "single-" + name.split("-")[1]
    a, b = (torch.load(out / x / "model.pt", weights_only=True) for x in (name, ref))
    assert_same_model(a, b, f"{name} vs {ref}", rtol=0, atol=SGD_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if n.startswith("zero3")])
def test_each_rank_keeps_its_chunk_of_the_frozen_weights(runs, name):
    """Measured frozen bytes on every rank == 4 Σ_u ceil(F_u / N) == theory's, about 1/N of the whole."""
    _, s = runs
    train, n = RUNS[name]
    summary = s[name]
    chunks = frozen_chunks(train, n, dict(TINY_GPT["workload"], **GPT2))
    whole = 4 * summary["frozen_params"]
    assert whole / n <= 4 * chunks < whole / n + 4 * 3   # under one padding element a unit (3: root, 2 blocks)
    assert summary["predicted"]["memory_per_rank"]["frozen"] == 4 * chunks
    assert [m["frozen"] for m in summary["memory"]["per_rank"]] == [4 * chunks] * n, name


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if n.startswith("zero3")])
def test_frozen_weights_are_gathered_twice_and_never_reduced(runs, name):
    """Bytes sent per step: the trainable parameters' 3 ring passes, (N - 1)/N · 4Φ each (plus their padding: at
    most N - 1 elements sent per unit, 3 units, and pass), and the all-gathers of the frozen chunks,
    (N - 1) · 4 Σ ceil(F_u / N) in forward and as much again in backward, less the units it never reaches
    (zero3-late-2's block 0);
    theory predicts the same with the trainable padding left out."""
    _, s = runs
    train, n = RUNS[name]
    summary = s[name]
    phi = summary["params"]
    workload = dict(TINY_GPT["workload"], **GPT2)
    frozen = (n - 1) * 4 * (frozen_chunks(train, n, workload) + frozen_chunks(train, n, workload, reached_only=True))
    if name == "zero3-late-2":   # block 0 gathered in forward only: fewer bytes than every unit twice
        assert frozen < 2 * (n - 1) * 4 * frozen_chunks(train, n, workload)
    trained = 3 * (n - 1) / n * 4 * phi
    assert summary["predicted"]["traffic_per_step"]["worker_sent"] == pytest.approx(trained + frozen, rel=1e-12)
    for t in summary["traffic"]["per_rank"]:
        assert trained + frozen <= t["sent_per_step"] <= trained + frozen + 3 * 3 * (n - 1) * 4, (name, t)
