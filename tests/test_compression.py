"""Gradient compression (`train.compression`, collective/compression.py): psarch's ddp against torch's own DDP
communication hooks, its bytes and error-feedback memory against their formulas, and the one-line refusals (the
PS's compressed pushes: tests/test_ps_compression.py).

Tolerances (each world size's runs in one spawned process group, the tiny GPT, SGD with momentum, 8 steps):
- fp16/bf16: psarch's cast, divide, all-reduce, cast back equals torch's fp16_compress_hook (bf16_compress_hook)
  exactly at N = 2, where a + b = b + a. At N = 3 the two differ in the order an element's three 2-byte values
  are added (which rank's chunk starts the sum depends on the element's place in the bucket, and torch's
  bucket orders parameters as their gradients arrive), at most two roundings per step: cast_bound carries that
  through SGD element by element (measured: the largest difference 1.3e-4 fp16, 9.4e-4 bf16).
- PowerSGD: exactly equal at N = 2; at N = 3 within SGD's 1e-5: the same plan, seeds, draw order and
  orthogonalisation, so only the fp32 all-reduces' summation order differs (measured 1.2e-7 at rank 1,
  4.5e-8 at rank 3), which the error feedback carries along but does not grow. A different Q draw, a missing error feedback or warm start moves
  parameters by ~lr x the gradient (1e-2 to 1e-3), 100x and more beyond it: test_compression_changes_the_model
  checks the compressed runs are that far from uncompressed training, so the parity is not vacuous.
"""
from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch

from dist_utils import run_ranks
from parity import SGD_ATOL, TINY_GPT, assert_same_model, config, model, train
from psarch.config import from_dict
from psarch.errors import ConfigError
from timing import scaled

SGD = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "steps": 8}
WARMUP = 2
RATIO = 0.1
# name -> (backend, train); every world size runs each
VARIANTS = {
    "none": ({"kind": "ddp"}, {}),
    "fp16-ring": ({"kind": "ddp"}, {"compression": "fp16"}),
    "fp16-native": ({"kind": "ddp", "comm": "native"}, {"compression": "fp16"}),
    "fp16-torch": ({"kind": "torch_ddp"}, {"compression": "fp16"}),
    "bf16-ring": ({"kind": "ddp"}, {"compression": "bf16"}),
    "bf16-torch": ({"kind": "torch_ddp"}, {"compression": "bf16"}),
    "topk-ring": ({"kind": "ddp"}, {"compression": "topk", "topk_ratio": RATIO}),
    "topk-native": ({"kind": "ddp", "comm": "native"}, {"compression": "topk", "topk_ratio": RATIO}),
    "topk-all": ({"kind": "ddp"}, {"compression": "topk", "topk_ratio": 1.0}),
    "topk-small-buckets": ({"kind": "ddp", "bucket_cap_mb": 0.002}, {"compression": "topk", "topk_ratio": RATIO}),
    **{f"powersgd{r}-{side}": (backend, {"compression": "powersgd", "powersgd_rank": r,
                                         "powersgd_warmup_steps": WARMUP})
       for r in (1, 3) for side, backend in (("ring", {"kind": "ddp"}), ("native", {"kind": "ddp", "comm": "native"}),
                                             ("torch", {"kind": "torch_ddp"}))},
    "powersgd-warm-only": ({"kind": "ddp"}, {"compression": "powersgd", "powersgd_warmup_steps": 8}),
    # the plain algorithm: one bucket per parameter, all-reduced after backward
    "powersgd2-plain": ({"kind": "ddp", "bucket_cap_mb": 0, "overlap_comm": False},
                        {"compression": "powersgd", "powersgd_rank": 2, "powersgd_warmup_steps": WARMUP}),
}


def data(name: str, n: int) -> dict:
    backend, train_ = VARIANTS[name]
    return config(f"{name}-{n}", train={**SGD, **train_}, backend={**backend, "world_size": n})


def every_variant(rank: int, n: int, out: str) -> dict:
    return {name: train(rank, n, data(name, n), {}, out) for name in VARIANTS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression")
    train(0, 1, config("single", train=SGD), {}, str(out))
    results: dict[int, dict] = {}
    for n in (2, 3):
        results[n] = run_ranks(every_variant, n, str(out), timeout=scaled(600))
    return out, results


def shapes() -> list[tuple[int, ...]]:
    """The tiny GPT's parameter shapes, in ddp's bucket order (reversed)."""
    from psarch.workload import build_workload
    return [tuple(p.shape) for p in build_workload(from_dict(config("x", train=SGD)), device="meta").model.parameters()][::-1]


def plan(rank: int, of: Sequence[tuple[int, ...]] | None = None) -> tuple[int, list[tuple[int, int, int]]]:
    """PowerSGD's plan of the shapes `of` (the tiny GPT's by default), counted here by hand from its rule: n x m
    factored at r = min(n, m, rank) where 2 (n + m) r < n m; the rest sent whole."""
    whole, factored = 0, []
    for s in shapes() if of is None else of:
        n, m = s[0], math.prod(s) // s[0]
        r = min(n, m, rank)
        if 2 * (n + m) * r < n * m:
            factored.append((n, m, r))
        else:
            whole += math.prod(s)
    return whole, factored


def ring(numel: int, n: int, itemsize: int = 4) -> int:
    return 2 * (n - 1) * -(-numel // n) * itemsize if numel else 0


def cast_bound(unit_roundoff: float) -> dict[str, torch.Tensor]:
    """How far, element by element, two runs may end apart whose averaged gradients differ only in the order
    N = 3 two-byte values are added: per step at most two roundings of the element's sum, 2 u |g|, carried into
    the parameter by SGD with momentum as lr x sum_t (1 - beta^t) / (1 - beta) (28.7 for 8 steps at 0.9); |g|
    the element's largest gradient in `single`'s run of the same steps, doubled for partial sums that exceed
    the total and for the runs' own drift."""
    from psarch.workload import build_workload
    cfg = from_dict(config("single", train=SGD))
    w = build_workload(cfg)
    opt = torch.optim.SGD(w.model.parameters(), lr=SGD["lr"], momentum=SGD["momentum"])
    biggest = {k: torch.zeros_like(p) for k, p in w.model.named_parameters()}
    for step in range(SGD["steps"]):
        opt.zero_grad()
        w.loss_fn(w.model, w.batch(step, 0, 1)).backward()
        for k, p in w.model.named_parameters():
            torch.maximum(biggest[k], p.grad.abs(), out=biggest[k])
        opt.step()
    return {k: 2 * carried() * 2 * unit_roundoff * g for k, g in biggest.items()}


def carried() -> float:
    """How much of a per-step gradient error SGD with momentum carries into a parameter over SGD's steps:
    lr x sum_t (1 - beta^t) / (1 - beta)."""
    beta = SGD["momentum"]
    return SGD["lr"] * sum((1 - beta**t) / (1 - beta) for t in range(1, SGD["steps"] + 1))


def assert_within(a: dict, b: dict, bound: dict, what: str) -> float:
    """Every element of a within its bound of b; returns the largest share of its bound an element used."""
    worst = 0.0
    for k in a:
        used = ((a[k] - b[k]).abs() / (bound[k] + 1e-9)).max().item()
        assert used <= 1, f"{what}: {k} differs by {used:.2f}x its bound"
        worst = max(worst, used)
    return worst


@pytest.mark.parametrize("n", [2, 3])
def test_psarch_fp16_and_powersgd_equal_torchs_hooks(runs, n):
    """N = 2: bitwise (two addends sum alike in any order). N = 3: PowerSGD within SGD's 1e-5, the casts within
    cast_bound (gloo's and the ring's chunks start the sum of an element at different ranks)."""
    out, _ = runs
    for name, unit_roundoff in (("fp16", 2.0**-11), ("bf16", 2.0**-8), ("powersgd1", None), ("powersgd3", None)):
        torch_model = model(out, f"{name}-torch-{n}")
        for side in ("ring", "native"):
            if name == "bf16" and side == "native":
                continue
            mine, what = model(out, f"{name}-{side}-{n}"), f"{name} {side} N={n} vs torch's hook"
            print(f"{what}: largest difference {max((mine[k] - v).abs().max().item() for k, v in torch_model.items()):.3g}")
            if n == 3 and unit_roundoff is not None:
                used = assert_within(mine, torch_model, cast_bound(unit_roundoff), what)
                print(f"{what}: at most {used:.3f} of the bound")
            else:
                assert_same_model(mine, torch_model, what, rtol=0, atol=0.0 if n == 2 else SGD_ATOL)


def all_reduces_per_step(rank: int, n: int) -> dict[str, list[list[int]]]:
    """The bytes of each all-reduce a rank issues in each of 4 steps (PowerSGD rank 3, 2 warm-up steps, the tiny GPT
    in one bucket): psarch's ddp (its communicator's calls) and torch's DDP with powerSGD_hook (the hook's calls of
    torch.distributed.all_reduce)."""
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as hook
    from torch.nn.parallel import DistributedDataParallel

    from collective.ddp import DDPTrainer
    from psarch.dist import DistContext
    from psarch.workload import build_workload

    cfg = from_dict(config("calls", train={**SGD, "compression": "powersgd", "powersgd_rank": 3,
                                           "powersgd_warmup_steps": 2}, backend={"kind": "ddp", "world_size": n}))
    calls: dict[str, list[list[int]]] = {"psarch": [], "torch": []}

    def counted(side: str, all_reduce):
        def call(tensor, *args, **kwargs):
            calls[side][-1].append(tensor.numel() * tensor.element_size())
            return all_reduce(tensor, *args, **kwargs)
        return call

    w = build_workload(cfg)
    trainer = DDPTrainer(w, cfg, DistContext(rank, n, rank, torch.device("cpu"), "gloo"))
    trainer.comm.all_reduce = counted("psarch", trainer.comm.all_reduce)
    for step in range(4):
        calls["psarch"].append([])
        trainer.step(w.batch(step, rank, n))
    trainer.close()
    w = build_workload(cfg)
    ddp = DistributedDataParallel(w.model, bucket_cap_mb=cfg.backend.bucket_cap_mb)
    ddp.register_comm_hook(hook.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=2,
                                              min_compression_rate=2, random_seed=cfg.seed), hook.powerSGD_hook)
    real, hook.dist.all_reduce = hook.dist.all_reduce, counted("torch", hook.dist.all_reduce)
    try:
        for step in range(4):
            calls["torch"].append([])
            w.loss_fn(ddp, w.batch(step, rank, n)).backward()
    finally:
        hook.dist.all_reduce = real
    return calls


def test_psarch_powersgd_sends_the_all_reduces_torchs_hook_sends():
    """Per bucket and compressed step, psarch's PowerSGD issues what torch's powerSGD_hook issues: three
    all-reduces in turn, of the tensors sent whole, of every P and of every Q, each batched into one all-reduce of
    theory's size (not one per matrix); a warm-up step one all-reduce of the bucket."""
    _, factored = plan(3)
    whole = sum(math.prod(s) for s in shapes()) - sum(a * m for a, m, _ in factored)
    sizes = [4 * whole, 4 * sum(a * r for a, _, r in factored), 4 * sum(m * r for _, m, r in factored)]
    calls = run_ranks(all_reduces_per_step, 2, timeout=scaled(120))[0]
    print(f"all-reduces per step, bytes: psarch {calls['psarch']}, torch's hook {calls['torch']}")
    assert calls["psarch"] == calls["torch"] == [[4 * sum(math.prod(s) for s in shapes())]] * 2 + [sizes] * 2


@pytest.mark.parametrize("n", [2, 3])
def test_compression_changes_the_model(runs, n):
    """The parity above is not vacuous: lossy compression ends far (100x the tolerance) from exact averaging,
    and the lossless limits (top-k of everything, PowerSGD still warming up) end at `single`'s model."""
    out, _ = runs
    ref = model(out, "single")
    assert_same_model(model(out, f"none-{n}"), ref, "uncompressed vs single", rtol=0, atol=SGD_ATOL)
    assert_same_model(model(out, f"topk-all-{n}"), ref, "top-k of every element vs single", rtol=0, atol=SGD_ATOL)
    assert_same_model(model(out, f"powersgd-warm-only-{n}"), ref, "PowerSGD in warm-up vs single", rtol=0,
                      atol=SGD_ATOL)
    for name in ("powersgd1-ring", "powersgd3-ring", "topk-ring", "fp16-ring"):
        far = max((model(out, f"{name}-{n}")[k] - v).abs().max().item() for k, v in ref.items())
        assert far > (100 if name != "fp16-ring" else 1) * SGD_ATOL, f"{name}: {far:g} from uncompressed"


@pytest.mark.parametrize("n", [2, 3])
def test_bytes_per_step_equal_the_formula(runs, n):
    """Measured (ring) and modelled (native, torch's hooks) bytes of every step equal the formula."""
    _, results = runs
    phi = sum(math.prod(s) for s in shapes())
    none = ring(phi, n)
    whole, factored = {}, {}
    for r in (1, 3):
        whole[r], factored[r] = plan(r)
    expected = {"none": [none] * 8, "fp16": [ring(phi, n, 2)] * 8, "bf16": [ring(phi, n, 2)] * 8,
                "topk": [(n - 1) * math.ceil(RATIO * phi) * (4 + 4)] * 8,
                **{f"powersgd{r}": [none] * WARMUP + [ring(whole[r], n) + ring(sum(a * k for a, _, k in factored[r]), n)
                                                      + ring(sum(m * k for _, m, k in factored[r]), n)] * (8 - WARMUP)
                   for r in (1, 3)}}
    assert expected["fp16"][0] * 2 == none   # exactly half (the padded chunks too, at these sizes)
    for name, volume in expected.items():
        for side in ("ring", "native", "torch"):
            run = f"{name}-{side}" if name != "none" else "none"
            if run not in VARIANTS or (name == "none" and side != "ring"):
                continue
            for rank, r in enumerate(results[n]):
                sent = [row["sent"] for row in r[run]["rows"]]
                assert sent == volume, f"{run} N={n} rank {rank}: {sent} != {volume}"
                if rank == 0:
                    print(f"{run} N={n}: bytes sent per step {sent} (Φ = {phi}); error feedback "
                          f"{r[run]['memory']['error_feedback']} B")
                assert [row["received"] for row in r[run]["rows"]] == volume
    # top-k per bucket: one all-gather of k (index, value) pairs per bucket, k = ceil(ratio x bucket)
    from collective.theory import ddp_bucket_shapes
    buckets = ddp_bucket_shapes(from_dict(data("topk-small-buckets", n)))
    assert len(buckets) > 3
    per_step = sum((n - 1) * math.ceil(RATIO * sum(math.prod(s) for s in b)) * 8 for b in buckets)
    assert [row["sent"] for row in results[n][0]["topk-small-buckets"]["rows"]] == [per_step] * 8


@pytest.mark.parametrize("n", [2, 3])
def test_error_feedback_memory_equals_the_formula(runs, n):
    """top-k: one error per gradient element (4 Φ); PowerSGD: that plus P and Q, (n + m) r per factored matrix,
    on psarch's ddp and in torch's PowerSGDState alike; fp16 keeps nothing."""
    _, results = runs
    phi = sum(math.prod(s) for s in shapes())
    expected = {"topk-ring": 4 * phi, "topk-native": 4 * phi, "fp16-ring": 0, "none": 0,
                **{f"powersgd{r}-{side}": 4 * (phi + sum((a + m) * k for a, m, k in plan(r)[1]))
                   for r in (1, 3) for side in ("ring", "native", "torch")}}
    for name, kept in expected.items():
        for rank, r in enumerate(results[n]):
            mem = r[name]["memory"]
            assert mem["error_feedback"] == kept, f"{name} N={n} rank {rank}"
            assert mem["buffers"] >= kept


@pytest.mark.parametrize("n", [2, 3])
def test_theory_predicts_the_compressed_bytes_and_memory(runs, n):
    from psarch.theory import predict
    _, results = runs
    for name in ("fp16-ring", "topk-ring", "topk-small-buckets", "powersgd1-ring", "powersgd3-torch",
                 "powersgd2-plain"):
        r = results[n][0][name]
        p = predict(from_dict(data(name, n)), r["params"])
        mean = sum(row["sent"] for row in r["rows"]) / len(r["rows"])
        assert p.link.sent == pytest.approx(mean, rel=1e-12), name
        assert p.memory_per_rank.buffers == r["memory"]["error_feedback"], name


@pytest.mark.parametrize("kind, sets, words", [
    ("zero", {"train.compression": "topk"}, "ZeRO reduce-scatters gradients"),
    ("torch_ddp", {"train.compression": "topk"}, "no top-k DDP communication hook"),
    ("ps", {"train.compression": "powersgd"}, "PowerSGD's two rounds"),
    ("single", {"train.compression": "fp16"}, "no gradient moves"),
    ("ddp", {"train.topk_ratio": 0.5}, "train.topk_ratio = 0.5: only train.compression = \"topk\""),
    ("ddp", {"train.compression": "fp16", "train.precision": "bf16"}, "already 2 bytes"),
    ("ddp", {"train.compression": "topk", "train.precision": "fp16"}, "loss scale"),
    ("torch_ddp", {"train.compression": "powersgd", "train.checkpoint_every": 2},
     "is not in backend.kind = \"torch_ddp\"'s checkpoints yet"),
    ("torch_ddp", {"train.compression": "powersgd", "train.powersgd_warmup_steps": 1}, "step 2 at the earliest"),
    ("ddp", {"train.compression": "zip"}, "train.compression = \"zip\""),
])
def test_refusals_are_one_line(kind, sets, words):
    from psarch.config import apply_overrides
    base = {**TINY_GPT, "backend": {"kind": kind, "world_size": 1 if kind == "single" else 2}}
    with pytest.raises(ConfigError) as e:
        from_dict(apply_overrides(base, sets))
    assert words in str(e.value) and "\n" not in str(e.value)
