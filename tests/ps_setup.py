"""What the parameter-server tests share: the tiny workload, optimizers, and config builders."""
from __future__ import annotations

import json

TINY_GPT = {
    "seed": 3,
    "workload": {"model": "gpt", "data": "markov", "seq_len": 8,
                 "gpt": {"n_layer": 1, "n_embd": 16, "n_head": 2}, "markov": {"vocab_size": 16, "branching": 3}},
    "train": {"steps": 6, "global_batch": 12, "log_every": 100},
}
OPTIMIZERS = {
    "sgd": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "adamw": {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6},
    "plain_sgd": {"optimizer": "sgd", "lr": 0.1},
}


def config(name: str, **sections) -> dict:
    data = json.loads(json.dumps(TINY_GPT))
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    data["name"] = name
    return data


def ps(n: int, mode: str = "sync", servers: int = 1, **extra) -> dict:
    return dict({"kind": "ps", "world_size": n, "mode": mode, "servers": servers, "timeout_s": 60.0}, **extra)
