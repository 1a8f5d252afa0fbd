"""psarch/ps/server/finite.py: the server's verdict on whether an update would stay finite, checked against the
real update. The dry run must agree with the real step exactly; the cheap gate must never pass a step that
overflows (its bound is tried at its edge: values just below SAFE, the most extreme ordinary hyper-parameters)."""
from __future__ import annotations

import copy as copy_module
import math

import pytest
import torch

from psarch.ps.server import finite
from psarch.ps.server.finite import SAFE, StepProbe, absmax, sum_is_finite

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}),
    "nesterov": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9, "nesterov": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-8}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-10, "initial_accumulator_value": 0.1}),
}


def _optimizer(name: str, numel: int, scale: float, **over) -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
    cls, kw = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel, generator=gen) * scale)
    opt = cls([p], fused=True, **dict(kw, **over))
    p.grad = torch.randn(numel, generator=gen) * scale
    opt.step()   # state exists, as on a server that has stepped before
    return opt, p


def _really_finite(opt: torch.optim.Optimizer, p: torch.nn.Parameter, grad: torch.Tensor) -> bool:
    """Step a copy of the optimizer: whether its parameters and state stay finite."""
    q = torch.nn.Parameter(p.detach().clone())
    copy = type(opt)([q], **{k: v for k, v in opt.param_groups[0].items() if k in opt.defaults
                             and k != "decoupled_weight_decay"})
    copy.load_state_dict(copy_module.deepcopy(opt.state_dict()))   # (load_state_dict shares tensors)
    q.grad = grad.clone()
    copy.step()
    return all(math.isfinite(absmax(t)) for t in [q, *copy.state[q].values()] if torch.is_tensor(t))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("scale", [1.0, 1e18, 1e20, 1e37, 3e38])
def test_the_dry_run_agrees_with_the_real_step(name, scale, monkeypatch):
    """Over two chunks and a tail, with gradients from ordinary to the edge of fp32: the dry run's verdict is
    the real step's, and the probe leaves the optimizer as it was."""
    monkeypatch.setattr(finite, "CHUNK", 1000)
    numel = 2 * 1000 + 17
    opt, p = _optimizer(name, numel, 1.0)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * scale
    before = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    probe = StepProbe(opt)
    verdict = probe._dry_run(opt.state[p], grad, 1.0)
    assert verdict == _really_finite(opt, p, grad)
    assert probe.finite(grad) == verdict
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_gate_passes_only_steps_that_stay_finite(name):
    """Parameters, gradient and state just below SAFE (second moments and sums at 0: the smallest denominators),
    with the most extreme ordinary hyper-parameters: the gate passes the step without a dry run, and the real
    step is indeed finite."""
    extreme = {"sgd": {"lr": 2.0**10, "momentum": 2.0**10, "weight_decay": 2.0**10, "dampening": -2.0**10},
               "nesterov": {"lr": 2.0**10, "momentum": 2.0**10},
               "adamw": {"lr": 2.0**10, "eps": 2.0**-40, "betas": (1 - 2.0**-30, 1 - 2.0**-30), "weight_decay": 2.0**10},
               "adagrad": {"lr": 2.0**10, "eps": 2.0**-40, "weight_decay": 2.0**10}}[name]
    opt, p = _optimizer(name, 1000, 1.0)
    opt.param_groups[0].update(extreme)
    with torch.no_grad():
        p.fill_(SAFE * 0.99)
        for k, v in opt.state[p].items():
            if torch.is_tensor(v) and v.dim():
                v.fill_(0.0 if k in ("exp_avg_sq", "sum") else SAFE * 0.99)
    grad = torch.full((1000,), SAFE * 0.99)
    probe = StepProbe(opt)
    probe._dry_run = lambda *a: pytest.fail("the gate should have decided")   # type: ignore[method-assign]
    assert probe.finite(grad) and _really_finite(opt, p, grad)


def test_sum_is_finite_agrees_with_the_sum(monkeypatch):
    monkeypatch.setattr(finite, "CHUNK", 1000)
    base = torch.randn(1005)
    for alpha, delta in ((1.0, torch.randn(1005)), (2.0, torch.full((1005,), 3e38)),
                         (1.0, torch.full((1005,), 3.4e38)), (-1.0, torch.full((1005,), 3.4e38))):
        assert sum_is_finite(base, delta, alpha) == bool(torch.isfinite(base + alpha * delta).all())
