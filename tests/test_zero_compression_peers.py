"""ZeRO's gradients cast to 2 bytes (`train.compression = "fp16" | "bf16"`, zero/wire.py) against PyTorch's own sharded
peers with the same cast: stages 1-2 against torch_zero (DDP with torch's fp16_compress_hook / bf16_compress_hook,
ZeroRedundancyOptimizer), stage 3 against torch_fsdp (FSDP2, MixedPrecisionPolicy(reduce_dtype=float16/bfloat16),
the parameters fp32); their modelled bytes per step against the formula; the refusals of top-k and PowerSGD.

Tolerances (each world size's runs in one spawned process group; test_compression.py's tiny GPT, SGD with momentum,
8 steps; reduce_bucket_size = 600):
- N = 2: bitwise. Every side casts each rank's fp32 gradient to 2 bytes and halves it (exact), adds the two 2-byte
  values once (a + b = b + a; FSDP2's fp16 pre-divides by 2 and post-divides by 1, its bf16 takes gloo's
  ReduceOp.AVG, where halving is exact too) and casts the sum back to fp32, so the averaged gradients are equal bit
  for bit and SGD steps the same numbers.
- N = 3, stages 1-2 against torch_zero: the three 2-byte values, each divided by 3 alike (fp16's subnormals
  included), are added in an order that depends on where an element falls in gloo's all-reduce and in psarch's
  ring: the situation of ddp's ring against torch's hook, test_compression.py's cast_bound (measured: at most 0.61 of
  it fp16, 0.66 bf16; largest differences 1.6e-4, 9.9e-4).
- N = 3, stage 3 against torch_fsdp: FSDP2 also divides elsewhere (fp16: by 2 before the sum and by 1.5 after it,
  torch's _get_gradient_divide_factors; bf16: gloo's ReduceOp.AVG), so each side is within three roundings of the
  exact mean of the same 2-byte addends (two additions and one division: psarch's of each addend,
  together at most u max|g_i|; FSDP2's of the sum): six apart, 3 x cast_bound. Where a quotient falls below fp16's
  normal range (2^-14) it rounds to a multiple of 2^-24 instead, each division at most half of that: 2 x 2^-24 a
  step (psarch's three, FSDP2's one), carried by SGD like the rest (measured: at most 0.20 of the bound fp16, 0.18
  bf16; largest differences 1.4e-4, 1.4e-3; without the subnormal term an element of the attention's tiny
  gradients used 1.03 of 2 x cast_bound).
- Not vacuous: every compressed peer ends more than SGD's 1e-5 from its uncompressed run (fp16 9.6e-5, bf16 6.0e-4
  at N = 2), so N = 2's bitwise equality tells the cast from none. N = 3's bounds do not: they admit the uncompressed
  runs too (measured: torch_zero's fp16 at 1.05 of cast_bound, bf16 0.45; torch_fsdp's 0.22 and 0.16 of its), as
  the order and place of the roundings move the model about as much as the cast itself; test_the_peers_cast_changes_
  the_model prints those shares.
"""
from __future__ import annotations

import pytest
import torch

from parity import SGD_ATOL, TINY_GPT, config, model
from psarch.config import apply_overrides, from_dict
from psarch.errors import ConfigError
from test_compression import SGD, assert_within, carried, cast_bound
from test_zero_compression import UNIT_ROUNDOFF, ZERO, largest_difference, run_variants
from test_zero_compression import data as variant_data

VARIANTS = {   # name -> (backend, compression)
    "zero1-fp16": ({**ZERO, "stage": 1}, "fp16"),
    "zero2-bf16": ({**ZERO, "stage": 2}, "bf16"),
    "zero3-fp16": ({**ZERO, "stage": 3}, "fp16"),
    "zero3-bf16": ({**ZERO, "stage": 3}, "bf16"),
    **{f"torch_zero-{c}": ({"kind": "torch_zero"}, c) for c in ("none", "fp16", "bf16")},
    **{f"torch_fsdp-{c}": ({"kind": "torch_fsdp"}, c) for c in ("none", "fp16", "bf16")},
}
PAIRS = {"zero1-fp16": "torch_zero-fp16", "zero2-bf16": "torch_zero-bf16", "zero3-fp16": "torch_fsdp-fp16",
         "zero3-bf16": "torch_fsdp-bf16"}
SUBNORMAL = {"fp16": 2.0**-24, "bf16": 2.0**-133}   # the spacing of each 2-byte format below its normal range


def data(name: str, n: int) -> dict:
    return variant_data(name, n, VARIANTS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero-compression-peers")
    return out, run_variants(out, VARIANTS)


def tolerance(peer: str, n: int) -> dict[str, torch.Tensor] | None:
    """None at N = 2 (bitwise), else each element's bound against `peer` (the docstring)."""
    if n == 2:
        return None
    kind, compression = peer.split("-")
    bound = cast_bound(UNIT_ROUNDOFF[compression])
    if kind == "torch_zero":
        return bound
    return {k: 3 * v + carried() * 2 * SUBNORMAL[compression] for k, v in bound.items()}


@pytest.mark.parametrize("n", [2, 3])
def test_zero_with_cast_gradients_equals_torchs_peer_with_the_same_cast(runs, n):
    out, _ = runs
    for mine, peer in PAIRS.items():
        a, b, what = model(out, f"{mine}-{n}"), model(out, f"{peer}-{n}"), f"{mine} vs {peer} N={n}"
        bound = tolerance(peer, n)
        print(f"{what}: largest difference {largest_difference(a, b):.3g}")
        if bound is None:
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), what
        else:
            print(f"{what}: at most {assert_within(a, b, bound, what):.3f} of the bound")


@pytest.mark.parametrize("n", [2, 3])
def test_the_peers_cast_changes_the_model(runs, n):
    """Not vacuous: each compressed peer ends beyond SGD's 1e-5 from the uncompressed one (what N = 2's bitwise parity
    needs); printed, where N = 3's parity bound would put the uncompressed run (the docstring)."""
    out, _ = runs
    for peer in PAIRS.values():
        kind, compression = peer.split("-")
        a, b = model(out, f"{peer}-{n}"), model(out, f"{kind}-none-{n}")
        far = largest_difference(a, b)
        print(f"{peer} N={n}: {far:.3g} from uncompressed")
        assert far > SGD_ATOL, f"{peer}: {far:g} from uncompressed"
        bound = tolerance(peer, n)
        if bound is not None:
            used = max(((a[k] - b[k]).abs() / (bound[k] + 1e-9)).max().item() for k in a)
            print(f"{peer} N={n}: uncompressed at {used:.2f} of the parity bound")


@pytest.mark.parametrize("n", [2, 3])
def test_the_peers_bytes_per_step_are_the_2_byte_formula(runs, n):
    """Modelled per step and rank: torch_fsdp's reduce-scatter (N-1)/N · Φ · 2, half the uncompressed one, its
    all-gathers unchanged; torch_zero's all-reduce, counted by the hook bucket by bucket, 2 (N-1) ceil(b/N) · 2 for
    a bucket of b elements (at most N - 1 padding elements a bucket above 2 (N-1)/N · Φ · 2), about half the
    uncompressed one, its broadcast unchanged; theory's predict the same with the padding left out."""
    from psarch.theory import predict
    _, results = runs
    steps = SGD["steps"]
    for kind, op in (("torch_fsdp", "reduce_scatter"), ("torch_zero", "all_reduce")):
        for compression in ("fp16", "bf16"):
            for rank, ranks in enumerate(results[n]):
                r, none = ranks[f"{kind}-{compression}"], ranks[f"{kind}-none"]
                phi, ops, whole = r["params"], r["traffic"]["ops"], none["traffic"]["ops"]
                passes = 1 if op == "reduce_scatter" else 2
                formula = passes * (n - 1) * phi * 2 / n
                sent = ops[op]["sent"] / steps
                buckets = ops[op].get("calls", steps) / steps
                assert formula - 1 <= sent <= formula + passes * (n - 1) * 2 * buckets, (kind, compression, sent)
                assert abs(2 * ops[op]["sent"] - whole[op]["sent"]) <= 2 * steps * passes * (n - 1) * 2 * buckets
                other = "all_gather" if kind == "torch_fsdp" else "broadcast"
                assert ops[other] == whole[other], (kind, other)
                predicted = predict(from_dict(data(f"{kind}-{compression}", n)), phi).link.sent
                per_step = sum(v["sent"] for v in ops.values()) / steps
                assert predicted - 1 <= per_step <= predicted + passes * (n - 1) * 2 * buckets + 1, (kind, compression)
                if rank == 0:
                    print(f"{kind} {compression} N={n}: {op} {sent:.0f} B a step (formula {formula:.0f}, "
                          f"uncompressed {whole[op]['sent'] / steps:.0f}); all ops {per_step:.0f}, predicted "
                          f"{predicted:.0f}")


@pytest.mark.parametrize("kind", ["torch_zero", "torch_fsdp"])
@pytest.mark.parametrize("compression", ["topk", "powersgd"])
def test_the_peers_refuse_top_k_and_powersgd_in_one_line(kind, compression):
    base = {**TINY_GPT, "backend": {"kind": kind, "world_size": 2}}
    with pytest.raises(ConfigError) as e:
        from_dict(apply_overrides(base, {"train.compression": compression}))
    text = str(e.value)
    assert "the peer of zero: ZeRO reduce-scatters gradients" in text and "\n" not in text
    assert 'runs "none", "fp16", "bf16" only' in text


@pytest.mark.parametrize("kind", ["torch_zero", "torch_fsdp"])
def test_the_peers_take_the_casts_and_say_so(kind):
    from psarch import registry
    cfg = from_dict(config("x", train={"compression": "fp16"}, backend={"kind": kind, "world_size": 2}))
    assert registry.spec_of(cfg).label(cfg).endswith(", fp16 grads")
