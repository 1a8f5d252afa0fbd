"""ZeRO's gradient reduce-scatter cast to 2 bytes (`train.compression = "fp16" | "bf16"`, zero/wire.py) against ddp's
cast all-reduce (collective/compression.py's Cast, torch's fp16_compress_hook), its bytes against the formula, and
the one-line refusals of top-k and PowerSGD.

Tolerances (each world size's runs in one spawned process group; tests/test_compression.py's tiny GPT, SGD with
momentum, 8 steps; reduce_bucket_size = 600, so stages 1-2 reduce about a dozen buckets, each padded on its own):
- N = 2: bitwise. Both cast each rank's fp32 gradient to 2 bytes, divide by 2 (exact), and add the two 2-byte
  values once (a + b = b + a), so the averaged gradients are equal bit for bit; the optimizer then steps the same
  numbers, the whole model in ddp and a rank's chunk in ZeRO.
- N = 3: each element's three 2-byte values are added in an order that depends on where the element falls in the
  chunks of ddp's all-reduce and of ZeRO's bucket (padded differently): at most two roundings per step apart,
  test_compression.py's cast_bound carried through SGD element by element.
- Not vacuous: the cast moves the model by more than SGD's 1e-5 from the uncompressed ZeRO run.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from parity import SGD_ATOL, TINY_GPT, assert_same_model, config, model, train
from psarch.config import from_dict
from psarch.errors import ConfigError
from test_compression import SGD, assert_within, cast_bound
from timing import scaled

ZERO = {"kind": "zero", "reduce_bucket_size": 600}
VARIANTS = {   # name -> (backend, compression)
    "ddp-fp16": ({"kind": "ddp"}, "fp16"),
    "ddp-bf16": ({"kind": "ddp"}, "bf16"),
    "zero1-none": ({**ZERO, "stage": 1}, "none"),
    "zero1-fp16": ({**ZERO, "stage": 1}, "fp16"),
    "zero2-fp16": ({**ZERO, "stage": 2}, "fp16"),
    "zero3-fp16": ({**ZERO, "stage": 3}, "fp16"),
    "zero2-fp16-blocking": ({**ZERO, "stage": 2, "overlap_comm": False}, "fp16"),
    "zero2-fp16-native": ({**ZERO, "stage": 2, "comm": "native"}, "fp16"),
    "zero3-bf16": ({**ZERO, "stage": 3}, "bf16"),
    "zero1-bf16-native": ({**ZERO, "stage": 1, "comm": "native"}, "bf16"),
}
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def data(name: str, n: int, variants: dict = VARIANTS) -> dict:
    backend, compression = variants[name]
    return config(f"{name}-{n}", train={**SGD, "compression": compression}, backend={**backend, "world_size": n})


def every_variant(rank: int, n: int, out: str, variants: dict) -> dict:
    return {name: train(rank, n, data(name, n, variants), {}, out) for name in variants}


def run_variants(out, variants: dict) -> dict:
    """Each of `variants` (name -> (backend, compression)) at N = 2 and 3, in one process group per world size."""
    return {n: run_ranks(every_variant, n, str(out), variants, timeout=scaled(300)) for n in (2, 3)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero-compression")
    return out, run_variants(out, VARIANTS)


def largest_difference(a: dict, b: dict) -> float:
    return max((a[k] - v).abs().max().item() for k, v in b.items())


@pytest.mark.parametrize("n", [2, 3])
def test_zero_with_cast_gradients_equals_ddps_cast_all_reduce(runs, n):
    out, _ = runs
    for name, (_, compression) in VARIANTS.items():
        if not name.startswith("zero") or compression == "none":
            continue
        mine, ddp, what = model(out, f"{name}-{n}"), model(out, f"ddp-{compression}-{n}"), f"{name} N={n} vs ddp"
        print(f"{what}: largest difference {largest_difference(mine, ddp):.3g}")
        if n == 2:
            assert_same_model(mine, ddp, what, rtol=0, atol=0)
        else:
            used = assert_within(mine, ddp, cast_bound(UNIT_ROUNDOFF[compression]), what)
            print(f"{what}: at most {used:.3f} of cast_bound")


@pytest.mark.parametrize("n", [2, 3])
def test_the_cast_changes_the_model(runs, n):
    """Not vacuous: fp16's roundings move ZeRO's model beyond SGD's 1e-5 from the uncompressed run."""
    out, _ = runs
    for name in ("zero1-fp16", "zero2-fp16", "zero3-fp16", "zero3-bf16"):
        far = largest_difference(model(out, f"{name}-{n}"), model(out, f"zero1-none-{n}"))
        print(f"{name} N={n}: {far:.3g} from uncompressed zero-1")
        assert far > SGD_ATOL, f"{name}: {far:g} from uncompressed"


@pytest.mark.parametrize("n", [2, 3])
def test_bytes_per_step_equal_the_formula(runs, n):
    """Per step and rank: the reduce-scatter moves (N-1)/N of the padded gradient elements at 2 bytes, the
    all-gathers (one in stages 1-2, two in stage 3) (N-1)/N of them at 4 (ring: counted on the wire; native:
    modelled); theory's predict, in Φ, is that less at most the padding's share; and the reduce-scatter is
    exactly half the uncompressed run's."""
    from psarch.theory import predict
    _, results = runs
    none = results[n][0]["zero1-none"]
    steps = SGD["steps"]
    for name, (backend, compression) in VARIANTS.items():
        if not name.startswith("zero") or compression == "none":
            continue
        for rank, ranks in enumerate(results[n]):
            r = ranks[name]
            padded, phi = r["extra"]["zero_padded_params"], r["params"]
            gathers = 2 if backend["stage"] == 3 else 1
            rs, ag = (n - 1) * padded * 2 // n, gathers * (n - 1) * padded * 4 // n
            assert [row["sent"] for row in r["rows"]] == [rs + ag] * steps, (name, rank)
            assert [row["received"] for row in r["rows"]] == [rs + ag] * steps, (name, rank)
            ops = r["traffic"]["ops"]
            assert ops["reduce_scatter"]["sent"] == steps * rs and ops["all_gather"]["sent"] == steps * ag, name
            predicted = predict(from_dict(data(name, n)), phi).link.sent
            assert predicted <= rs + ag <= predicted + (3 * (n - 1) * (padded - phi) * 4) / n + 1, name
            if rank == 0:
                print(f"{name} N={n}: sent per step {rs + ag} B (reduce-scatter {rs}, all-gathers {ag}); predicted "
                      f"{predicted:.1f} (Φ = {phi}, padded {padded})")
            if backend["stage"] == 1:
                assert 2 * ops["reduce_scatter"]["sent"] == none["traffic"]["ops"]["reduce_scatter"]["sent"]


def test_the_wire_casts_gradients_only():
    """zero/wire.py without processes: "none" divides in place and reduces into the chunk itself; "fp16" sends a
    2-byte copy divided by N and lands what comes back in the fp32 chunk."""
    from psarch.meters import Transient
    from zero.wire import GradientWire

    grad, chunk = torch.tensor([1.0, 3.0, 0.25, 7.0]), torch.zeros(2)
    sent, received, land = GradientWire(2, "none", Transient()).send(grad, chunk)
    assert sent is grad and received is chunk and grad.tolist() == [0.5, 1.5, 0.125, 3.5]
    grad = torch.tensor([1 / 3, 3.0, 0.25, 7.0])
    booked = Transient()
    sent, received, land = GradientWire(2, "fp16", booked).send(grad, chunk)
    assert sent.dtype == received.dtype == torch.float16 and received.numel() == 2
    assert sent.tolist() == grad.half().div(2).tolist() and booked.now["send"] == 12
    received.copy_(sent[:2] + sent[2:])   # what a reduce-scatter of two ranks with this gradient would leave
    land()
    assert chunk.dtype == torch.float32 and chunk.tolist() == (sent[:2] + sent[2:]).float().tolist()
    assert booked.now["send"] == 0


@pytest.mark.parametrize("compression", ["topk", "powersgd"])
def test_top_k_and_powersgd_are_still_refused_in_one_line(compression):
    from psarch.config import apply_overrides
    base = {**TINY_GPT, "backend": {"kind": "zero", "world_size": 2}}
    with pytest.raises(ConfigError) as e:
        from_dict(apply_overrides(base, {"train.compression": compression}))
    text = str(e.value)
    assert "ZeRO reduce-scatters gradients" in text and "\n" not in text
    assert 'runs "none", "fp16", "bf16" only' in text and "not built" not in text


def test_the_label_says_the_gradients_are_cast():
    from psarch import registry
    cfg = from_dict(config("x", train={"compression": "bf16"}, backend={"kind": "zero", "stage": 3, "world_size": 2}))
    assert registry.spec_of(cfg).label(cfg) == "zero-3 ring, bf16 grads"
