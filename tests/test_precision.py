"""Mixed precision: the loss scaler, fp32 masters, the optimizer wrapper, and model.pt's fp32 state."""
from __future__ import annotations

import io

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from psarch.config import load_config
from psarch.optim import build_optimizer
from psarch.precision import (LossScaler, MasterWeights, MixedPrecisionOptimizer, compute_dtype,
                              has_inf_or_nan)


# ---------------------------------------------------------------- LossScaler

def test_scaler_defaults():
    s = LossScaler(enabled=True)
    assert s.scale == 2.0**16
    assert (s.growth_interval, s.hysteresis, s.min_scale) == (1000, 2, 1.0)
    assert s.scale_loss(torch.tensor(3.0)).item() == 3.0 * 2**16


def test_scaler_hysteresis_first_overflow_keeps_second_halves():
    s = LossScaler(enabled=True)
    s.update(True)
    assert s.scale == 2.0**16            # first overflow: skipped, scale kept
    s.update(True)
    assert s.scale == 2.0**15            # second: halved
    s.update(True)
    assert s.scale == 2.0**14            # hysteresis spent: every further overflow halves (as Megatron)
    s.update(False)
    s.update(True)
    assert s.scale == 2.0**13            # a clean step does not re-arm it; only growth does


def test_scaler_hysteresis_need_not_be_consecutive():
    s = LossScaler(enabled=True)
    s.update(True)
    for _ in range(10):
        s.update(False)
    s.update(True)
    assert s.scale == 2.0**15


def test_scaler_growth_after_1000_clean_steps():
    s = LossScaler(enabled=True)
    for _ in range(999):
        s.update(False)
    assert s.scale == 2.0**16
    s.update(False)
    assert s.scale == 2.0**17            # 1000 clean steps in a row: doubled
    for _ in range(1000):
        s.update(False)
    assert s.scale == 2.0**18


def test_scaler_overflow_restarts_the_growth_window():
    s = LossScaler(enabled=True)
    for _ in range(999):
        s.update(False)
    s.update(True)                       # hysteresis absorbs it, but the clean run starts again
    assert s.scale == 2.0**16
    for _ in range(999):
        s.update(False)
    assert s.scale == 2.0**16
    s.update(False)
    assert s.scale == 2.0**17


def test_scaler_growth_rearms_hysteresis():
    s = LossScaler(enabled=True)
    s.update(True)
    s.update(True)                       # 2^15, hysteresis spent
    for _ in range(1000):
        s.update(False)
    assert s.scale == 2.0**16            # grown back, hysteresis re-armed
    s.update(True)
    assert s.scale == 2.0**16            # so the next overflow is absorbed again
    s.update(True)
    assert s.scale == 2.0**15


def test_scaler_never_below_min():
    s = LossScaler(enabled=True)
    for _ in range(100):
        s.update(True)
    assert s.scale == 1.0
    s = LossScaler(enabled=True, init_scale=8.0, min_scale=2.0)
    for _ in range(10):
        s.update(True)
    assert s.scale == 2.0


def test_scaler_state_dict_round_trip():
    s = LossScaler(enabled=True)
    s.update(True)
    for _ in range(7):
        s.update(False)
    t = LossScaler(enabled=True)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    for _ in range(993):
        t.update(False)
    assert t.scale == 2.0**17            # the clean-step count came across (7 + 993 = 1000)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_scaler_disabled_for_fp32_and_bf16(precision):
    opt = MixedPrecisionOptimizer([torch.nn.Parameter(torch.ones(3))], load_config().train, precision)
    s = opt.scaler
    assert not s.enabled and s.scale == 1.0
    for _ in range(5):
        s.update(True)
    for _ in range(1000):
        s.update(False)
    assert s.scale == 1.0
    loss = torch.tensor(2.5)
    assert s.scale_loss(loss) is loss
    assert MixedPrecisionOptimizer([torch.nn.Parameter(torch.ones(3, dtype=torch.float16))],
                                   load_config().train, "fp16").scaler.enabled


def test_has_inf_or_nan():
    assert has_inf_or_nan([torch.ones(3), torch.zeros(2)]).item() == 0.0
    assert has_inf_or_nan([torch.ones(3), torch.tensor([1.0, float("inf")])]).item() == 1.0
    assert has_inf_or_nan([torch.tensor([float("nan")], dtype=torch.float16)]).item() == 1.0
    assert has_inf_or_nan([]).item() == 0.0
    assert has_inf_or_nan([torch.empty(0)]).item() == 0.0


def test_compute_dtype():
    assert compute_dtype("fp32") is torch.float32
    assert compute_dtype("bf16") is torch.bfloat16
    assert compute_dtype("fp16") is torch.float16


# ---------------------------------------------------------------- masters and the optimizer

def sgd(lr: float = 1.0):
    return load_config(None, ["train.optimizer=sgd", f"train.lr={lr}"]).train


def test_master_weights_fp32_are_the_model_tensors():
    p = torch.nn.Parameter(torch.ones(4))
    mw = MasterWeights([p])
    assert not mw.copies and mw.masters[0] is p and mw.bytes() == 0


def test_master_weights_low_precision_are_fp32_copies():
    p = torch.nn.Parameter(torch.full((4,), 1.5, dtype=torch.bfloat16))
    mw = MasterWeights([p])
    assert mw.copies and mw.masters[0].dtype == torch.float32
    assert mw.masters[0].data_ptr() != p.data_ptr()
    assert torch.equal(mw.masters[0], torch.full((4,), 1.5)) and mw.bytes() == 16


def test_fp16_overflow_skips_the_step_and_leaves_masters_alone():
    p = torch.nn.Parameter(torch.full((4,), 1.0, dtype=torch.float16))
    opt = MixedPrecisionOptimizer([p], sgd(0.5), "fp16")
    scale = opt.scaler.scale
    bad = torch.tensor([1.0, float("inf"), 0.0, 0.0], dtype=torch.float16)
    assert opt.step([bad]) is True
    assert torch.equal(opt.master.masters[0], torch.ones(4)) and torch.equal(p, torch.ones(4, dtype=torch.float16))
    assert opt.scaler.scale == scale     # hysteresis: first overflow keeps the scale
    nan = torch.tensor([float("nan"), 0.0, 0.0, 0.0], dtype=torch.float16)
    assert opt.step([nan]) is True
    assert torch.equal(opt.master.masters[0], torch.ones(4))
    assert opt.scaler.scale == scale / 2
    # a clean step, gradients scaled by the loss scale: unscaled before the update
    s = opt.scaler.scale
    good = torch.full((4,), 0.25 * s, dtype=torch.float16)
    assert opt.step([good]) is False
    torch.testing.assert_close(opt.master.masters[0], torch.full((4,), 1.0 - 0.5 * 0.25))
    torch.testing.assert_close(p, torch.full((4,), 0.875, dtype=torch.float16))
    assert opt.master.masters[0].grad is None   # fp32 gradient copies are transient


def test_found_inf_passed_in_overrides_the_local_check():
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = MixedPrecisionOptimizer([p], sgd(), "fp16")
    assert opt.step([torch.zeros(2, dtype=torch.float16)], found_inf=True) is True
    assert torch.equal(opt.master.masters[0], torch.ones(2))


def test_bf16_keeps_fp32_masters_and_writes_back():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = MixedPrecisionOptimizer([p], sgd(1.0), "bf16")
    m = opt.master.masters[0]
    assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
    g = torch.full((3,), 1e-3, dtype=torch.bfloat16)
    g32 = g.float()                      # the gradient bf16 can carry
    for k in range(1, 11):
        assert opt.step([g]) is False
        torch.testing.assert_close(m, torch.ones(3) - k * g32, rtol=0, atol=1e-7)  # exact in fp32
        assert torch.equal(p, m.to(torch.bfloat16))                                 # written back
    # a single update of 1e-3 is below bf16's resolution at 1.0: without masters nothing would move
    assert (torch.ones(3, dtype=torch.bfloat16) - g).eq(1.0).all()
    assert p[0].item() < 1.0
    assert opt.state_bytes() == 12       # SGD without momentum: no state, 3 fp32 masters


def test_fp32_optimizer_steps_model_tensors_in_place():
    p = torch.nn.Parameter(torch.ones(3))
    opt = MixedPrecisionOptimizer([p], load_config(None, ["train.lr=0.1"]).train, "fp32")
    assert opt.step([torch.ones(3)]) is False
    assert (p < 1).all()                 # AdamW's first step moves every weight by ~lr
    torch.testing.assert_close(p, torch.full((3,), 0.9), atol=1e-5, rtol=0)
    assert opt.state_bytes() == 3 * 8 + 4  # exp_avg + exp_avg_sq + step counter; no masters


def test_optimizer_state_dict_round_trip_with_masters():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = MixedPrecisionOptimizer([p], load_config().train, "fp16")
    opt.step([torch.full((3,), 100.0, dtype=torch.float16)])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)    # as a checkpoint would: torch's optimizer state_dict holds references
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    q = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt2 = MixedPrecisionOptimizer([q], load_config().train, "fp16")
    opt2.load_state_dict(state)
    assert torch.equal(opt2.master.masters[0], opt.master.masters[0])
    assert torch.equal(q, p)
    opt.step([torch.ones(3, dtype=torch.float16)])
    opt2.step([torch.ones(3, dtype=torch.float16)])
    assert torch.equal(opt2.master.masters[0], opt.master.masters[0])


def hyper(opt: str):
    sets = (["train.optimizer=sgd", "train.lr=0.1", "train.momentum=0.9", "train.weight_decay=0.01"]
            if opt == "sgd" else ["train.lr=0.01", "train.weight_decay=0.1", "train.eps=1e-6"])
    return load_config(None, sets).train


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_flat_fused_path_equals_the_plain_per_tensor_optimizer(opt, precision):
    """The fast path (one flat fp32 master, one fused kernel, one cast in, one copy back) against the
    plain one (an fp32 copy per tensor, torch's per-tensor loop, foreach=False), 5 steps on tensors whose
    sizes leave vector tails. Both are element-wise; fused SGD may round a multiply-add of a tail element
    differently (one ulp, ~1e-7 at these magnitudes), so rtol 1e-6 / atol 2e-7: a gradient given to the
    wrong tensor, not unscaled or not written back is off by ~lr (1e-2..1e-1)."""
    dtype = compute_dtype(precision)
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (33, 5), (129,), (3, 3, 3)]
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    fast_tensors = [t.clone() for t in init]
    fast = MixedPrecisionOptimizer(fast_tensors, hyper(opt), precision)
    plain_params = [torch.nn.Parameter(t.float().clone()) for t in init]
    plain = build_optimizer(plain_params, hyper(opt), fused=False)
    for _ in range(5):
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        assert fast.step([g.clone() for g in grads]) is False
        for p, g in zip(plain_params, grads):
            p.grad = g.float()
        plain.step()
    for t, m, p in zip(fast_tensors, fast.master.masters, plain_params):
        torch.testing.assert_close(m, p.detach(), rtol=1e-6, atol=2e-7)
        assert torch.equal(t, m.to(dtype))                      # the model tensors got the update
    assert (fast.master.masters[0] - init[0].float()).abs().max() > 1e-3  # it did train


class KernelCount(TorchDispatchMode):
    """Counts the operators dispatched that compute (views, which launch nothing, are left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        if schema.is_mutable or not (schema.returns and schema.returns[0].alias_info is not None):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_optimizer_path_issues_no_per_parameter_kernels(precision):
    """The operators one step dispatches do not grow with the number of model tensors (3 or 30)."""
    counts = []
    for k in (3, 30):
        tensors = [torch.ones(10, dtype=compute_dtype(precision)) for _ in range(k)]
        opt = MixedPrecisionOptimizer(tensors, hyper("adamw"), precision)
        grads = [torch.full((10,), 0.5, dtype=compute_dtype(precision)) for _ in range(k)]
        opt.step(grads)                  # the first step creates the optimizer state
        with KernelCount() as c:
            assert opt.step(grads) is False
        counts.append(c.count)
    assert counts[0] == counts[1] and counts[0] < 20, counts


def test_consolidated_state_takes_the_master_under_every_name_of_a_tied_weight():
    """model.pt holds the fp32 master of a tied weight under each of its names, never the bf16 copy."""
    from psarch.trainer import consolidated_state

    emb, head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head).to(torch.bfloat16)
    master = torch.randn(5, 3) / 3  # fp32 values a bf16 copy cannot hold exactly
    for copy in (True, False):
        out = consolidated_state(model, {id(emb.weight): master}, copy=copy)
        assert set(out) == {"0.weight", "1.weight"}
        for name, value in out.items():
            assert value.dtype == torch.float32 and value.device.type == "cpu" and torch.equal(value, master), name
