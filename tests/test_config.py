"""Config: defaults, precedence, `base` inheritance, and one-line errors that name key, value and what is allowed.

Pure unit tests: no processes."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

from psarch.config import (Config, ConfigError, apply_overrides, check_machine, from_dict, load_config,
                           describe, parse_override, resolve_factory)


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


# ---------------------------------------------------------------- one error per kind of mistake

def test_unknown_top_level_key():
    msg = error(None, ["stepz=5"])
    assert msg.startswith("stepz")
    assert_names(msg, "unknown key", "seed", "train", "workload", "backend")


def test_unknown_nested_key(tmp_path):
    msg = error(None, ["train.stepz=5"])
    assert_names(msg, "train.stepz", "unknown key", "[train]", "steps", "global_batch")
    p = write(tmp_path / "x.toml", "[workload.gpt]\nn_layers = 2\n")
    msg = error(p)
    assert_names(msg, "workload.gpt.n_layers", "unknown key", "n_layer", "n_embd", "n_head")


@pytest.mark.parametrize("override, value", [
    ('train.steps="5"', '"5"'),      # string for int
    ("train.steps=true", "true"),    # bool for int
    ("train.steps=5.5", "5.5"),      # float for int
    ("backend.world_size=2.0", "2.0"),
])
def test_wrong_type_for_int(override, value):
    key = override.split("=")[0]
    msg = error(None, [override])
    assert_names(msg, f"{key} = {value}", "expected an integer")


def test_wrong_type_other_kinds():
    assert_names(error(None, ["train.lr=true"]), "train.lr = true", "expected a number")
    assert_names(error(None, ["train.nesterov=1"]), "train.nesterov = 1", "true or false")
    assert_names(error(None, ["name=3"]), "name = 3", "expected a string")
    assert_names(error(None, ["train.betas=0.9"]), "train.betas = 0.9", "expected a list")
    assert_names(error(None, ["workload.gpt=5"]), "workload.gpt = 5", "table")
    assert_names(error(None, ["train.steps.x=1"]), "train.steps", "expected an integer")


def test_toml_dates_give_a_config_error_not_a_crash():
    msg = error(None, ["seed=1979-05-27"])
    assert_names(msg, "seed = ", "1979-05-27", "expected an integer")


def test_non_finite_floats_are_rejected():
    assert_names(error(None, ["train.lr=nan"]), "train.lr = NaN", "finite")
    assert_names(error(None, ["backend.timeout_s=inf"]), "backend.timeout_s = Infinity", "finite")


@pytest.mark.parametrize("override, key, value, allowed", [
    ("train.optimizer=adam", "train.optimizer", '"adam"', '"sgd", "adamw"'),
    ("train.precision=fp8", "train.precision", '"fp8"', '"fp32", "bf16", "fp16"'),
    ("backend.kind=horovod", "backend.kind", '"horovod"', '"single", "ddp", "zero", "ps"'),
    ("backend.stage=4", "backend.stage", "4", "1, 2, 3"),
    ("backend.mode=fast", "backend.mode", '"fast"', '"sync", "async", "geo", "ssp"'),
    ("workload.model=rnn", "workload.model", '"rnn"', '"gpt", "mlp"'),
])
def test_bad_choice(override, key, value, allowed):
    msg = error(None, [override])
    assert_names(msg, f"{key} = {value}", "allowed values are", allowed)


@pytest.mark.parametrize("override, key, value, bound", [
    ("train.steps=0", "train.steps", "0", ">= 1"),
    ("train.lr=-0.1", "train.lr", "-0.1", ">= 0"),
    ("backend.world_size=0", "backend.world_size", "0", ">= 1"),
    ("workload.markov.vocab_size=1", "workload.markov.vocab_size", "1", ">= 2"),
    ("backend.timeout_s=0.01", "backend.timeout_s", "0.01", ">= 0.1"),
])
def test_below_minimum(override, key, value, bound):
    msg = error(None, [override])
    assert_names(msg, f"{key} = {value}", "must be", bound)


def test_above_maximum():
    msg = error(None, ["workload.markov.vocab_size=100000"])
    assert_names(msg, "workload.markov.vocab_size = 100000", "must be <= 65536")
    assert load_config(None, ["workload.markov.vocab_size=65536"]).workload.markov.vocab_size == 65536


@pytest.mark.parametrize("name", ["../../x", "a/../../x", "..", "/tmp/x", "."])
def test_run_name_must_stay_under_runs(name):
    assert_names(error(None, [f'name="{name}"']), f'name = "{name}"', "relative", "..")


def test_run_name_may_have_a_folder():
    assert load_config(None, ['name="sweep/point"']).name == "sweep/point"  # how sweep points are named


def test_torch_peers_run_fp32_only():
    msg = error(None, ["backend.kind=torch_fsdp", "backend.world_size=2", "train.precision=bf16"])
    assert_names(msg, 'train.precision = "bf16"', "torch_fsdp", "fp32 only")
    load_config(None, ["backend.kind=torch_ddp", "backend.world_size=2", "train.precision=bf16"])  # it casts


def test_global_batch_not_divisible_by_world_size():
    msg = error(None, ["backend.kind=ddp", "backend.world_size=3", "train.global_batch=16"])
    assert_names(msg, "train.global_batch = 16", "divisible", "backend.world_size = 3")
    load_config(None, ["backend.kind=ddp", "backend.world_size=4", "train.global_batch=16"])  # the fix passes


def test_single_with_more_than_one_worker():
    msg = error(None, ["backend.world_size=2"])
    assert_names(msg, "backend.world_size = 2", "single", "1 worker")


def test_gpt_heads_must_divide_width():
    msg = error(None, ["workload.gpt.n_embd=30", "workload.gpt.n_head=4"])
    assert_names(msg, "workload.gpt.n_head = 4", "workload.gpt.n_embd = 30", "divide")
    load_config(None, ["workload.model=mlp", "workload.gpt.n_embd=30", "workload.gpt.n_head=4"])  # not a gpt


def test_markov_branching_cannot_exceed_vocab():
    msg = error(None, ["workload.markov.vocab_size=8", "workload.markov.branching=9"])
    assert_names(msg, "workload.markov.branching = 9", "workload.markov.vocab_size = 8")


def test_text_data_needs_a_path():
    msg = error(None, ["workload.data=text"])
    assert_names(msg, "workload.text.path", '""', "text file")
    assert load_config(None, ["workload.data=text", "workload.text.path=x.txt"]).workload.text.path == "x.txt"


@pytest.mark.parametrize("text", ["train.steps", "=5", "train..steps=5", ".steps=5", "train.=5"])
def test_malformed_set(text):
    msg = error(None, [text])
    assert_names(msg, "--set", text, "section.key=value")


def test_bad_factory_spec():
    msg = error(None, ["workload.factory=mypkg.make"])
    assert_names(msg, 'workload.factory = "mypkg.make"', "package.module:function")


@pytest.mark.parametrize("betas", ["[0.9]", "[0.9, 0.99, 0.999]", "[0.9, 1.5]", '[0.9, "x"]', "[false, 0.9]"])
def test_betas_must_be_two_numbers_in_range(betas):
    msg = error(None, [f"train.betas={betas}"])
    assert_names(msg, "train.betas = [", "two numbers in [0, 1)")


def test_betas_ints_become_floats():
    assert load_config(None, ["train.betas=[0, 0.5]"]).train.betas == [0.0, 0.5]


def test_nesterov_needs_sgd_with_momentum():
    msg = error(None, ["train.nesterov=true"])
    assert_names(msg, "train.nesterov = true", "sgd", "momentum")
    cfg = load_config(None, ["train.nesterov=true", "train.optimizer=sgd", "train.momentum=0.9"])
    assert cfg.train.nesterov


@pytest.mark.parametrize("sets, names", [
    (["train.optimizer=adagrad", "train.momentum=0.9"], ("train.momentum = 0.9", '"sgd"', '"adagrad"')),
    (["train.optimizer=adamw", "train.momentum=0.5"], ("train.momentum = 0.5", '"sgd"', '"adamw"')),
    (["train.optimizer=sgd", "train.initial_accumulator_value=0.1"],
     ("train.initial_accumulator_value = 0.1", '"adagrad"', '"sgd"')),
])
def test_an_optimizer_option_the_optimizer_lacks_is_refused(sets, names):
    """Momentum with Adagrad or AdamW, an accumulator with SGD or AdamW: torch would ignore it without a word."""
    assert_names(error(None, sets), *names)
    load_config(None, ["train.optimizer=adagrad", "train.initial_accumulator_value=0.1"])   # where they belong
    load_config(None, ["train.optimizer=sgd", "train.momentum=0.9"])


def test_invalid_toml_file(tmp_path):
    p = write(tmp_path / "broken.toml", "[train\nsteps = \n")
    msg = error(p)
    assert_names(msg, "broken.toml", "not valid TOML")


def test_missing_file(tmp_path):
    msg = error(tmp_path / "absent.toml")
    assert_names(msg, "absent.toml", "no such file")


def test_config_file_not_utf8(tmp_path):
    p = tmp_path / "latin1.toml"
    p.write_bytes("name = \"caf\u00e9\"\n".encode("latin-1"))
    assert_names(error(p), "latin1.toml", "not UTF-8")


def test_wrong_type_in_file_names_the_nested_key(tmp_path):
    p = write(tmp_path / "w.toml", '[workload.markov]\nbranching = "four"\n')
    assert_names(error(p), 'workload.markov.branching = "four"', "expected an integer")


# ---------------------------------------------------------------- round trip

def test_to_dict_round_trips():
    cfg = load_config(None, ["train.steps=3", "backend.kind=zero", "backend.world_size=2", "backend.stage=3",
                             "workload.model=mlp", "train.betas=[0.8, 0.95]"])
    again = from_dict(cfg.to_dict())
    assert again == cfg
    assert dataclasses.asdict(again) == cfg.to_dict()


# ---------------------------------------------------------------- this machine: devices and files

def machine_error(overrides: list[str]) -> str:
    cfg = load_config(None, overrides)  # valid as a config: the machine is what lacks
    with pytest.raises(ConfigError) as info:
        check_machine(cfg)
    msg = str(info.value)
    assert msg and "\n" not in msg
    return msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only machine")
def test_cuda_asked_for_on_a_cpu_machine():
    assert_names(machine_error(["backend.device=cuda"]), 'backend.device = "cuda"', "no CUDA device", '"cpu"')
    msg = machine_error(["backend.kind=ddp", "backend.world_size=2", "backend.dist_backend=nccl"])
    assert_names(msg, 'backend.dist_backend = "nccl"', "no CUDA device", '"gloo"')


def test_text_file_must_exist_and_hold_one_sequence(tmp_path):
    text = tmp_path / "t.txt"
    base = ["workload.data=text", f"workload.text.path={text}", "workload.seq_len=8"]
    assert_names(machine_error(base), f'workload.text.path = "{text}"', "no such file")
    text.write_bytes(b"")
    assert_names(machine_error(base), "has 0 bytes", "workload.seq_len = 8", "at least 9")
    text.write_bytes(b"12345678")
    assert_names(machine_error(base), "has 8 bytes", "at least 9")
    text.write_bytes(b"123456789")
    check_machine(load_config(None, base))  # one sequence and its target: enough
    check_machine(load_config(None, ["workload.data=text", "workload.text.path=nowhere.txt",
                                     "workload.factory=psarch.workload:build_workload"]))  # a factory replaces data


def test_factory_module_in_the_working_directory(tmp_path, monkeypatch):
    """As under `python -m`: the console script's sys.path[0] is its bin folder, not the working directory."""
    (tmp_path / "psarch_cwd_factory_mod.py").write_text("def make():\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    try:
        assert resolve_factory("psarch_cwd_factory_mod:make")() == 1
        assert str(tmp_path) in sys.path
    finally:
        sys.modules.pop("psarch_cwd_factory_mod", None)
