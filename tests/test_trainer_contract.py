"""The Trainer contract is an ABC: a backend whose trainer leaves an abstract method out fails when its spec
loads it, a class outside the contract is refused, and a backend's StepStats.extra cannot shadow core columns."""
from __future__ import annotations

import pytest
import torch

from psarch import registry
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.launch.runner import run_rank
from psarch.single import SingleTrainer
from psarch.single_spec import SingleSpec
from psarch.trainer import StepStats, Trainer, load_trainer

TINY = {"workload": {"model": "mlp", "seq_len": 4, "mlp": {"n_embd": 8, "hidden": 16, "n_layer": 1},
                     "markov": {"vocab_size": 8, "branching": 2}},
        "train": {"steps": 2, "global_batch": 2, "log_every": 100}}


def test_every_backend_loads_a_complete_trainer():
    for spec in registry.specs():
        try:
            cls = load_trainer(spec.kind)
        except RuntimeError as e:   # a peer torch does not ship here: nothing to check
            assert "not available" in str(e)
            continue
        assert issubclass(cls, Trainer) and not cls.__abstractmethods__, spec.kind
        cfg = from_dict({"backend": {"kind": spec.kind}})
        assert isinstance(spec.tolerates_lost_workers(cfg), bool) and isinstance(spec.needs_process_group, bool)


class Elsewhere(SingleSpec):
    trainer = "collections:OrderedDict"


class Incomplete(Trainer):
    """Forgot traffic() and the rest."""

    def step(self, batch) -> StepStats:
        return StepStats(0.0)


class IncompleteSpec(SingleSpec):
    trainer = f"{__name__}:Incomplete"


def test_a_class_outside_the_contract_or_short_of_it_is_refused(monkeypatch):
    monkeypatch.setitem(registry._specs, "single", Elsewhere())
    with pytest.raises(RuntimeError, match="collections:OrderedDict does not subclass psarch.trainer.Trainer"):
        load_trainer("single")
    monkeypatch.setitem(registry._specs, "single", IncompleteSpec())
    with pytest.raises(RuntimeError, match=r"does not implement .*traffic"):
        load_trainer("single")


class ShadowingTrainer(SingleTrainer):
    """A backend whose extra figures reuse core column names."""

    def step(self, batch) -> StepStats:
        stats = super().step(batch)
        stats.extra = {"loss": -1.0, "sent": -5, "step_time_s": -2.0, "version": 7}
        return stats


def test_step_extra_is_nested_and_cannot_shadow_core_columns(monkeypatch):
    monkeypatch.setattr("psarch.trainer.load_trainer", lambda kind: ShadowingTrainer)
    record = run_rank(from_dict(TINY), DistContext(0, 1, 0, torch.device("cpu")), echo=False)
    for row in record.steps:
        assert row["extra"] == {"loss": -1.0, "sent": -5, "step_time_s": -2.0, "version": 7}
        assert row["loss"] > 0 and row["sent"] == 0 and row["step_time_s"] > 0
    assert record.extra == {}   # summary_extra's default
