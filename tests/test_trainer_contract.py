"""The Trainer protocol is the whole contract: the registry accepts only its subclasses, the members the
launcher and runner read have defaults there, and a backend's StepStats.extra cannot shadow core columns."""
from __future__ import annotations

import pytest
import torch

from psarch import registry
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.runner import run_rank
from psarch.single import SingleTrainer
from psarch.trainer import StepStats, Trainer

TINY = {"workload": {"model": "mlp", "seq_len": 4, "mlp": {"n_embd": 8, "hidden": 16, "n_layer": 1},
                     "markov": {"vocab_size": 8, "branching": 2}},
        "train": {"steps": 2, "global_batch": 2, "log_every": 100}}


def test_every_backend_subclasses_trainer_and_reads_its_members():
    for kind in registry.BACKENDS:
        try:
            cls = registry.trainer_class(kind)
        except RuntimeError as e:   # a peer torch does not ship here: nothing to check
            assert "not available" in str(e)
            continue
        assert Trainer in cls.__mro__, kind
        assert isinstance(cls.synchronous, bool) and isinstance(cls.needs_process_group, bool), kind
        assert isinstance(cls.tolerates_lost_workers(from_dict({"backend": {"kind": kind}})), bool), kind


def test_a_class_outside_the_contract_is_refused(monkeypatch):
    monkeypatch.setitem(registry.BACKENDS, "single", "collections:OrderedDict")
    with pytest.raises(RuntimeError, match="collections:OrderedDict does not subclass psarch.trainer.Trainer"):
        registry.trainer_class("single")


class ShadowingTrainer(SingleTrainer):
    """A backend whose extra figures reuse core column names."""

    def step(self, batch) -> StepStats:
        stats = super().step(batch)
        stats.extra = {"loss": -1.0, "sent": -5, "step_time_s": -2.0, "version": 7}
        return stats


def test_step_extra_is_nested_and_cannot_shadow_core_columns(monkeypatch):
    monkeypatch.setattr("psarch.runner.trainer_class", lambda kind: ShadowingTrainer)
    record = run_rank(from_dict(TINY), DistContext(0, 1, 0, torch.device("cpu")), echo=False)
    for row in record["rows"]:
        assert row["extra"] == {"loss": -1.0, "sent": -5, "step_time_s": -2.0, "version": 7}
        assert row["loss"] > 0 and row["sent"] == 0 and row["step_time_s"] > 0
    assert record["extra"] == {}   # summary_extra's default
