"""ZeRO-3 with a loss that reads parameters outside the model's forward (an L2 term in loss_fn): the units read
are gathered and kept until their gradients are reduced, and the run matches `single`."""
from __future__ import annotations

import pytest
import torch

from psarch.config import from_dict
from psarch.launch.ranks import run


def _run(tmp_path, name: str, factory: str, backend: dict, precision: str) -> dict[str, torch.Tensor]:
    cfg = from_dict({"name": name, "workload": {"factory": f"finite_factories:{factory}"},
                     "train": {"steps": 4, "global_batch": 8, "optimizer": "sgd", "lr": 0.05, "log_every": 100,
                               "precision": precision},
                     "backend": dict(backend, timeout_s=30.0)})
    run(cfg, tmp_path / name, echo=False)
    return torch.load(tmp_path / name / "model.pt", weights_only=True)


@pytest.mark.parametrize("factory,precision,atol", [("l2_on_every_parameter", "fp32", 1e-5),
                                                     ("l2_on_some_parameters", "fp32", 1e-5),
                                                     ("l2_on_every_parameter", "bf16", 2e-2)])
def test_zero3_gathers_parameters_read_outside_forward(tmp_path, factory, precision, atol):
    single = _run(tmp_path, "single", factory, {"kind": "single", "world_size": 1}, precision)
    zero3 = _run(tmp_path, "zero3", factory, {"kind": "zero", "world_size": 2, "stage": 3}, precision)
    assert single.keys() == zero3.keys()
    for name, value in single.items():
        torch.testing.assert_close(zero3[name], value, rtol=0, atol=atol, msg=name)
