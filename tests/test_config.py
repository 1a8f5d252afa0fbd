"""Config: defaults, precedence, `base` inheritance and the round trip (one-line errors: tests/test_config_errors.py;
what this machine lacks: tests/test_config_machine.py).

Pure unit tests: no processes."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from psarch.config import Config, ConfigError, apply_overrides, from_dict, load_config, describe, parse_override


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def error(path=None, overrides=None) -> str:
    """The message of the ConfigError that loading raises; asserts it is exactly one line."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    msg = str(info.value)
    assert msg and "\n" not in msg and "\r" not in msg, f"not one line: {msg!r}"
    return msg


def assert_names(msg: str, *parts: str) -> None:
    for p in parts:
        assert p in msg, f"{p!r} missing from config error: {msg!r}"


# ---------------------------------------------------------------- defaults and precedence

def test_defaults_load():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.name == "run"
    assert cfg.seed == 0
    assert cfg.workload.model == "gpt" and cfg.workload.data == "markov"
    assert cfg.train.optimizer == "adamw" and cfg.train.precision == "fp32"
    assert cfg.train.betas == [0.9, 0.999]
    assert cfg.backend.kind == "single" and cfg.backend.world_size == 1
    assert not hasattr(cfg.backend, "comm")    # single's [backend] is the core's alone
    for kind, key, default in (("ddp", "comm", "ring"), ("zero", "stage", 1), ("ps", "mode", "sync")):
        assert getattr(load_config(None, [f"backend.kind={kind}"]).backend, key) == default
    # every key the design fixes is in the vocabulary
    keys = {k for k, _, _ in describe()}
    for k in ("name", "seed", "workload.model", "workload.data", "workload.factory", "train.steps",
              "train.global_batch", "train.optimizer", "train.lr", "train.precision", "backend.kind",
              "backend.world_size", "backend.comm", "backend.stage", "backend.mode", "backend.servers",
              "backend.k_steps", "backend.geo_barrier", "backend.staleness_bound",
              "backend.staleness_compensation", "backend.timeout_s", "backend.bucket_cap_mb",
              "backend.overlap_comm", "backend.reduce_bucket_size", "backend.allgather_bucket_size",
              "backend.prefetch_bucket_size"):
        assert k in keys, k


def test_default_lists_are_not_shared():
    a, b = load_config(), load_config()
    a.train.betas.append(0.5)
    assert b.train.betas == [0.9, 0.999]


def test_name_defaults_to_file_stem(tmp_path):
    cfg = load_config(write(tmp_path / "my_exp.toml", "seed = 3\n"))
    assert cfg.name == "my_exp" and cfg.seed == 3
    cfg = load_config(write(tmp_path / "other.toml", 'name = "given"\n'))
    assert cfg.name == "given"


def test_file_overrides_defaults_and_set_overrides_file(tmp_path):
    p = write(tmp_path / "exp.toml", """
seed = 5
[train]
steps = 7
lr = 0.5
[backend]
kind = "ddp"
world_size = 2
""")
    cfg = load_config(p)
    assert (cfg.seed, cfg.train.steps, cfg.train.lr, cfg.backend.kind, cfg.backend.world_size) == (5, 7, 0.5, "ddp", 2)
    assert cfg.train.global_batch == 16  # untouched default
    cfg = load_config(p, ["train.steps=9", "seed=11", "backend.comm=native", 'workload.model="mlp"'])
    assert cfg.train.steps == 9 and cfg.seed == 11
    assert cfg.backend.comm == "native"      # a bare word is read as a string
    assert cfg.workload.model == "mlp"
    assert cfg.train.lr == 0.5               # from the file, not overridden
    # the dict form of overrides too
    cfg = load_config(p, {"train.lr": 0.25})
    assert cfg.train.lr == 0.25 and cfg.train.steps == 7


def test_set_values_are_read_as_toml():
    assert parse_override("train.betas=[0.8, 0.9]") == (["train", "betas"], [0.8, 0.9])
    assert parse_override("train.nesterov=true") == (["train", "nesterov"], True)
    assert parse_override("train.lr=1e-2") == (["train", "lr"], 0.01)
    assert parse_override("name=hello world") == (["name"], "hello world")
    assert parse_override(" train.steps = 3") == (["train", "steps"], 3)
    cfg = load_config(None, ["train.lr=3"])  # an int is accepted for a float key, and becomes a float
    assert cfg.train.lr == 3.0 and isinstance(cfg.train.lr, float)


def test_apply_overrides_does_not_mutate_input():
    data = {"train": {"steps": 3}}
    out = apply_overrides(data, ["train.steps=4", "backend.kind=ddp"])
    assert data == {"train": {"steps": 3}}
    assert out == {"train": {"steps": 4}, "backend": {"kind": "ddp"}}


def test_base_inheritance_merges_nested_tables(tmp_path):
    write(tmp_path / "root.toml", """
seed = 1
[workload.gpt]
n_layer = 3
n_embd = 48
n_head = 4
[train]
steps = 100
lr = 0.1
""")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "mid.toml", """
base = "../root.toml"
[workload.gpt]
n_embd = 32
[train]
steps = 50
""")
    child = write(tmp_path / "sub" / "child.toml", """
base = "mid.toml"
[workload.gpt]
n_head = 2
""")
    cfg = load_config(child)
    g = cfg.workload.gpt
    assert (g.n_layer, g.n_embd, g.n_head) == (3, 32, 2)  # each level adds to the table, none replaces it
    assert cfg.train.steps == 50 and cfg.train.lr == 0.1 and cfg.seed == 1
    assert cfg.name == "child"
    cfg = load_config(child, ["workload.gpt.n_layer=1"])  # --set beats the whole chain
    assert cfg.workload.gpt.n_layer == 1 and cfg.workload.gpt.n_embd == 32


def test_base_cycle_is_an_error(tmp_path):
    a = write(tmp_path / "a.toml", 'base = "b.toml"\nseed = 1\n')
    write(tmp_path / "b.toml", 'base = "a.toml"\nseed = 2\n')
    msg = error(a)
    assert_names(msg, "base", "cycle", "a.toml", "b.toml")
    selfref = write(tmp_path / "self.toml", 'base = "self.toml"\n')
    assert_names(error(selfref), "base", "cycle", "self.toml")


def test_base_missing_file_and_wrong_type(tmp_path):
    p = write(tmp_path / "c.toml", 'base = "nope.toml"\n')
    assert_names(error(p), "nope.toml", "no such file")
    p = write(tmp_path / "d.toml", "base = 3\n")
    assert_names(error(p), "base = 3", "path")


# ---------------------------------------------------------------- round trip

def test_to_dict_round_trips():
    cfg = load_config(None, ["train.steps=3", "backend.kind=zero", "backend.world_size=2", "backend.stage=3",
                             "workload.model=mlp", "train.betas=[0.8, 0.95]"])
    again = from_dict(cfg.to_dict())
    assert again == cfg
    assert dataclasses.asdict(again) == cfg.to_dict()
