"""A non-finite loss stops the run, for every backend, naming the step and the worker whose loss went bad
(not a peer that the all-reduce or the servers spread it to), exits non-zero even in the modes that go on
without a lost worker, and leaves no poisoned model.pt behind."""
from __future__ import annotations

import pytest
import torch

from psarch.config import from_dict
from psarch.errors import NonFiniteError, check_loss
from psarch.launch.ranks import RunError, run

# The check is the runner's, the same for every backend: these cover one process, an all-reduce that
# spreads the NaN, a mode that goes on without lost workers, and GEO's local steps (zero, torch_* and ps
# sync were checked the same way by hand; each costs ~8 s of CPU on the suite's budget).
BACKENDS = {
    "single": {"kind": "single", "world_size": 1},
    "ddp": {"kind": "ddp", "world_size": 2},
    "ps-async": {"kind": "ps", "world_size": 2, "mode": "async"},
    "ps-geo": {"kind": "ps", "world_size": 2, "mode": "geo", "k_steps": 2},
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_nan_loss_stops_the_run_naming_step_and_worker(backend, tmp_path):
    b = BACKENDS[backend]
    cfg = from_dict({"name": "nan", "workload": {"factory": "factories:nan_loss_on_last_shard_at_step_3"},
                     "train": {"steps": 5, "global_batch": 8, "optimizer": "sgd", "lr": 0.05, "log_every": 100},
                     "backend": dict(b, timeout_s=30.0)})
    with pytest.raises(RunError, match=rf"step 3: worker {b['world_size'] - 1}'s loss is nan"):
        run(cfg, tmp_path / backend, echo=False)
    model = tmp_path / backend / "model.pt"
    if model.exists():   # async: worker 0 may have finished first; its model is the servers', never poisoned
        assert all(bool(t.isfinite().all()) for t in torch.load(model).values())


def test_check_loss_spares_fp16_skipped_steps_and_finite_losses():
    check_loss(2, 0, float("inf"), skipped=True)   # fp16's designed skip
    check_loss(2, 0, 1.5)
    with pytest.raises(NonFiniteError, match=r"step 7: worker 3's loss is inf"):
        check_loss(7, 3, float("inf"))
