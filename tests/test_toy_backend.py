"""A backend defined entirely here, registered, and run through everything a user touches: `psarch keys`,
config validation, `psarch run` (its ranks spawned: they register it too), `psarch compare` and theory,
with no edit to the core. The toy is the reference trainer on each rank's shard, unsynchronised (a local
SGD that never averages), with one option of its own."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from psarch import registry, theory
from psarch.backend import BackendSpec
from psarch.cli import main
from psarch.config import ConfigError, load_config
from psarch.config.backend import CoreBackendConfig
from psarch.config.fields import option
from psarch.single import SingleTrainer
from psarch.theory import LinkBytes, Prediction, sharded_memory

TINY = ["workload.model=\"mlp\"", "workload.seq_len=4", "workload.mlp.n_embd=8", "workload.mlp.hidden=16",
        "workload.mlp.n_layer=1", "workload.markov.vocab_size=8", "workload.markov.branching=2",
        "train.steps=4", "train.global_batch=4", "train.log_every=2"]


@dataclass(frozen=True)
class ToyOptions(CoreBackendConfig):
    toy_echo: int = option(0, "a number the toy repeats in its summary", min=0)


class ToyTrainer(SingleTrainer):
    """The reference trainer on this rank's shard; says its option back."""

    def __init__(self, workload: Any, cfg: Any, ctx: Any) -> None:
        super().__init__(workload, cfg, ctx)
        self.echo = cfg.backend.toy_echo

    def summary_extra(self) -> dict[str, Any]:
        return {"toy_echo": self.echo}


class ToySpec(BackendSpec):
    kind = "toy"
    trainer = f"{__name__}:ToyTrainer"
    doc = "the reference on each rank's shard, never averaged (a test's backend)"
    options = ToyOptions
    needs_process_group = False
    precisions = ("fp32",)

    def variant(self, cfg: Any) -> str:
        return f"echo{cfg.backend.toy_echo}"

    def predict(self, cfg: Any, phi: float) -> Prediction:
        return Prediction.alike(sharded_memory(cfg, phi, 0), LinkBytes(), cfg.backend.world_size, rounds=0, messages=0)


@pytest.fixture
def toy():
    spec = registry.register(ToySpec())
    yield spec
    registry.unregister("toy")


def test_keys_list_the_toy_and_its_option(toy, capsys):
    assert main(["keys"]) == 0
    out = capsys.readouterr().out
    kind = next(line for line in out.splitlines() if line.startswith("backend.kind "))
    assert '"toy"' in kind
    echo = next(line for line in out.splitlines() if line.startswith("backend.toy_echo "))
    assert 'only backend.kind = "toy"' in echo and "repeats in its summary" in echo


def test_validation_asks_the_toy(toy):
    cfg = load_config(None, ["backend.kind=\"toy\"", "backend.world_size=2", "backend.toy_echo=3"])
    assert cfg.backend.toy_echo == 3 and theory.predict(cfg, 100).memory_per_rank.total == 16 * 100
    with pytest.raises(ConfigError, match='backend.toy_echo = 3: applies only to backend.kind = "toy"'):
        load_config(None, ["backend.kind=\"ddp\"", "backend.world_size=2", "backend.toy_echo=3"])
    with pytest.raises(ConfigError, match='train.precision = "bf16": backend.kind = "toy" runs fp32 only'):
        load_config(None, ["backend.kind=\"toy\"", "train.precision=\"bf16\""])
    with pytest.raises(ConfigError, match="backend.toy_echo = -1: must be >= 0"):
        load_config(None, ["backend.kind=\"toy\"", "backend.toy_echo=-1"])


def test_without_registration_there_is_no_toy():
    with pytest.raises(ConfigError, match='backend.kind = "toy": allowed values are'):
        load_config(None, ["backend.kind=\"toy\""])
    with pytest.raises(ConfigError, match="backend.toy_echo = 1: unknown key"):
        load_config(None, ["backend.toy_echo=1"])


def test_run_and_compare(toy, tmp_path, capsys):
    sets = [a for s in TINY for a in ("--set", s)]
    toy_run, ref_run = tmp_path / "toy", tmp_path / "single"
    # the quickstart sets backend.comm, which the toy does not read: --set backend.kind drops it, with a note
    assert main(["run", "experiments/quickstart.toml", "--out", str(toy_run), *sets, "--set", "backend.kind=\"toy\"",
                 "--set", "backend.world_size=2", "--set", "backend.toy_echo=7", "--quiet"]) == 0
    assert 'psarch: note: backend.comm = "ring" (set in quickstart.toml) is not read by this run: applies only to' \
        in capsys.readouterr().err
    assert "comm" not in json.loads((toy_run / "config.json").read_text())["backend"]   # the toy's class: no comm
    summary = json.loads((toy_run / "summary.json").read_text())
    assert summary["label"] == "toy echo7" and summary["world_size"] == 2 and summary["steps"] == 4
    assert summary["extra"]["toy_echo"] == [7, 7]   # both spawned ranks built the toy's trainer
    assert summary["predicted"]["memory_per_rank"]["total"] == 16 * summary["params"]   # the toy's theory
    (tmp_path / "single.toml").write_text('[backend]\nkind = "single"\n')
    assert main(["run", str(tmp_path / "single.toml"), "--out", str(ref_run), *sets, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["compare", str(toy_run), str(ref_run), "--out", str(tmp_path / "cmp")]) == 0
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert "| toy echo7 |" in report and "| single |" in report
