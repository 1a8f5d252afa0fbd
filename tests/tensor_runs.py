"""The runs test_tensor.py looks at, one spawned process group per world size (start-up is the cost):
N = 4: t = 4, and t = 2 x dp = 2 (ring and native), under SGD and AdamW, one writing checkpoints and measuring
the blocks' activations; ZeRO-3 writing a checkpoint that t = 4 continues; torch's tensor parallelism at
t = 2 x dp = 2, writing checkpoints. N = 2: t = 2 (ring, native; bf16), a straight run with checkpoints and its
resumption, the t = 2 x dp = 2 checkpoint continued as ddp, torch's t = 2, and its checkpoint continued as t = 2."""
from __future__ import annotations

import json
from pathlib import Path

import parity
from parity import OPTIMIZERS, train

TINY_GPT = json.loads(json.dumps(parity.TINY_GPT))
TINY_GPT["workload"]["gpt"] = {"n_layer": 2, "n_embd": 16, "n_head": 4}   # 4 heads: t = 4 splits them
TENSOR = {"kind": "tensor", "comm": "ring"}


def config(name: str, opt: str, backend: dict, n: int, **train_options) -> dict:
    return parity.config(name, TINY_GPT, train=dict(OPTIMIZERS[opt], **train_options),
                         backend=dict(backend, world_size=n))


def checkpoints(out: str, name: str) -> Path:
    return Path(out) / name / "checkpoints"


def step3(out: str, name: str) -> Path:
    return checkpoints(out, name) / "step_000003"


def world4(rank: int, n: int, out: str) -> dict:
    runs = {
        "t4-sgd": config("t4-sgd", "sgd", TENSOR, n),
        "t4-adamw": config("t4-adamw", "adamw", TENSOR, n),
        "t2dp2-sgd": config("t2dp2-sgd", "sgd", dict(TENSOR, tensor_parallel=2), n),
        "t2dp2-adamw": config("t2dp2-adamw", "adamw", dict(TENSOR, tensor_parallel=2, measure_activations=True), n,
                              checkpoint_every=3),
        "t2dp2-native-sgd": config("t2dp2-native-sgd", "sgd", dict(TENSOR, tensor_parallel=2, comm="native"), n),
        "z3n4": config("z3n4", "adamw", {"kind": "zero", "stage": 3}, n, checkpoint_every=3),
        "torch-t2dp2-adamw": config("torch-t2dp2-adamw", "adamw", {"kind": "torch_tensor", "tensor_parallel": 2}, n,
                                    checkpoint_every=3),
    }
    results = {}
    for name, data in runs.items():
        ckpts = checkpoints(out, name) if data["train"].get("checkpoint_every") else None
        results[name] = train(rank, n, data, {}, out, checkpoints=ckpts)
    results["z3n4-to-t4"] = train(rank, n, config("z3n4-to-t4", "adamw", TENSOR, n), {}, out,
                                  start=step3(out, "z3n4"))
    return results


def world2(rank: int, n: int, out: str) -> dict:
    results = {
        "t2-sgd": train(rank, n, config("t2-sgd", "sgd", TENSOR, n), {}, out),
        "t2-native-adamw": train(rank, n, config("t2-native-adamw", "adamw", dict(TENSOR, comm="native"), n), {}, out),
        "t2-adamw": train(rank, n, config("t2-adamw", "adamw", TENSOR, n, checkpoint_every=3), {}, out,
                          checkpoints=checkpoints(out, "t2-adamw")),
    }
    results["t2-adamw-resumed"] = train(rank, n, config("t2-adamw-resumed", "adamw", TENSOR, n), {}, out,
                                        start=step3(out, "t2-adamw"), resume=True)
    results["t2dp2-to-ddp2"] = train(rank, n, config("t2dp2-to-ddp2", "adamw", {"kind": "ddp"}, n), {}, out,
                                     start=step3(out, "t2dp2-adamw"))
    results["t2-bf16"] = train(rank, n, config("t2-bf16", "adamw", dict(TENSOR, measure_activations=True), n,
                                               precision="bf16"), {}, out)
    results["torch-t2-sgd"] = train(rank, n, config("torch-t2-sgd", "sgd", {"kind": "torch_tensor"}, n), {}, out)
    results["torch-to-t2"] = train(rank, n, config("torch-to-t2", "adamw", TENSOR, n), {}, out,
                                   start=step3(out, "torch-t2dp2-adamw"))
    return results
