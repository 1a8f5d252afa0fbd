"""Config errors: one line per kind of mistake, naming key, value and what is allowed.

Pure unit tests: no processes."""
from __future__ import annotations

import pytest

from psarch.config import load_config
from test_config import assert_names, error, write

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
