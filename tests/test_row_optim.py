"""Row-wise optimizers (psarch/ps/row_optim.py) against torch's dense ones on the whole table: SGD and
Adagrad (no weight decay) equal the dense update when untouched rows get a zero gradient; lazy AdamW
equals AdamW only where every row is touched, and otherwise leaves untouched rows and their step counts be."""
from __future__ import annotations

import pytest
import torch

from psarch.config import from_dict
from psarch.optim import build_optimizer
from psarch.ps.row_optim import RowOptimizer

ROWS, DIM, STEPS = 20, 3, 6
TRAIN = {"sgd": {"optimizer": "sgd", "lr": 0.3},
         "adagrad": {"optimizer": "adagrad", "lr": 0.2, "eps": 1e-8, "initial_accumulator_value": 0.1},
         "adamw": {"optimizer": "adamw", "lr": 0.05, "weight_decay": 0.1, "eps": 1e-8}}


def _both(opt: str, touched: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, RowOptimizer]:
    """(rows after the row-wise updates, the table after torch's dense updates, the row optimizer)."""
    t = from_dict({"train": TRAIN[opt]}).train
    g = torch.Generator().manual_seed(0)
    init = torch.randn(ROWS, DIM, generator=g)
    rows, dense = init.clone(), torch.nn.Parameter(init.clone())
    row_opt, dense_opt = RowOptimizer(rows, t), build_optimizer([dense], t)
    for idx in touched:
        grad = torch.randn(idx.numel(), DIM, generator=g)
        row_opt.step(idx, grad)
        full = torch.zeros(ROWS, DIM)
        full[idx] = grad              # untouched rows: an exact zero gradient, as autograd gives them
        dense.grad = full
        dense_opt.step()
    return rows, dense.detach(), row_opt


def _subsets() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randperm(ROWS, generator=g)[:5].sort().values for _ in range(STEPS)]


@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_sgd_and_adagrad_rows_equal_the_dense_update(opt):
    rows, dense, _ = _both(opt, _subsets())
    assert not torch.equal(rows, _both(opt, [])[0]), "nothing was updated"
    torch.testing.assert_close(rows, dense, rtol=1e-6, atol=1e-6)


def test_lazy_adamw_equals_adamw_when_every_row_is_touched():
    rows, dense, opt = _both("adamw", [torch.arange(ROWS)] * STEPS)
    torch.testing.assert_close(rows, dense, rtol=1e-5, atol=1e-6)
    assert torch.equal(opt.state["step"], torch.full((ROWS,), STEPS))


def test_lazy_adamw_leaves_untouched_rows_and_their_step_counts():
    subsets = _subsets()
    rows, dense, opt = _both("adamw", subsets)
    counts = torch.zeros(ROWS, dtype=torch.int64)
    for idx in subsets:
        counts[idx] += 1
    assert torch.equal(opt.state["step"], counts)          # per-row step counts
    init = _both("adamw", [])[0]
    never = counts == 0
    assert never.any() and torch.equal(rows[never], init[never])
    # dense AdamW moves rows whose moments are non-zero even on a zero gradient: not the same optimizer
    assert (rows - dense).abs().max() > 1e-3


def test_row_sgd_refuses_momentum():
    t = from_dict({"train": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}}).train
    with pytest.raises(ValueError, match="train.momentum = 0.9: row-wise SGD on the parameter server has no momentum"):
        RowOptimizer(torch.zeros(2, 2), t)
