"""What every parity test shares: the tolerance, and how saved models are compared.

fp32, rtol 1e-4 / atol 1e-5 on every parameter after a few steps: backends differ only in the order
per-sample gradients are summed (~1e-7 relative per step); a missing or wrong synchronisation moves
parameters by about one learning rate (1e-2), 1000x the tolerance. See tests/test_ddp.py's docstring."""
from __future__ import annotations

from pathlib import Path

import torch

RTOL, ATOL = 1e-4, 1e-5


def model(out: Path, name: str) -> dict[str, torch.Tensor]:
    """The state_dict a test run saved as `out/name.pt`."""
    return torch.load(out / f"{name}.pt", weights_only=True)


def assert_same_model(a: dict, b: dict, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {k}: {m}")
