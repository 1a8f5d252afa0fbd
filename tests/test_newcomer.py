"""What a new user meets first: switching the quickstart's backend from the command line, a factory next to a
config that names a built-in model."""
from __future__ import annotations

from pathlib import Path

from psarch.config import load_config

QUICKSTART = Path(__file__).resolve().parent.parent / "experiments" / "quickstart.toml"


def test_set_backend_kind_on_the_quickstart_drops_what_the_new_backend_does_not_read():
    notes: list[str] = []
    cfg = load_config(QUICKSTART, ['backend.kind="ps"'], notes)
    assert cfg.backend.kind == "ps" and cfg.backend.world_size == 4
    assert notes == ['backend.comm = "ring" (set in quickstart.toml) is not read by this run: applies only to '
                     'backend.kind = "ddp", "zero"; this run has backend.kind = "ps", backend.mode = "sync"; dropped']


def test_a_factory_over_a_built_in_model_says_the_model_is_not_read():
    notes: list[str] = []
    cfg = load_config(QUICKSTART, ['workload.factory="factories:regression"', 'workload.model="mlp"'], notes)
    assert cfg.workload.factory == "factories:regression" and cfg.workload.model == "gpt"   # dropped: its default
    assert notes == ['workload.model = "mlp" (--set), workload.data = "markov" (set in quickstart.toml) are not read '
                     'by this run: workload.factory = "factories:regression" replaces the built-in model and data; '
                     'dropped']
