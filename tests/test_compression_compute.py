"""A compression's own work is in the step programs of the backends that compress: PowerSGD's products and
orthonormalisations priced at the device's FLOP rate (peak x mfu), top-k's selection, memory-bound, at its memory
bandwidth (collective/compression_theory.py's compression_work, psarch/ps/theory.py's compressing_bytes). With the links all but
free, the simulated step of ddp (psarch's ring), torch_ddp (its PowerSGD hook) and the PS (top-k pushes) grows by
exactly that work's time over the same program priced on a device of unknown rates (the work left out)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from collective.compression_theory import TOPK_PASSES, compression_work, powersgd_plan
from collective.theory import ddp_bucket_shapes
from psarch import registry
from psarch.cluster.device import rates
from psarch.config import from_dict
from psarch.ps.theory import TOPK_PUSH_PASSES, dense_partitions
from psarch.theory.program import Cluster, DataStep
from psarch.theory.simulate import simulate
from psarch.workload import build_workload

FLOPS, MEMORY = 1e9, 1e10   # a slow device, so its compression work shows beside a step of 1 s
FAST = 1e13                 # bytes/s on every link: the transfers take next to nothing


def test_powersgd_flops_are_the_products_and_orthonormalisations():
    """Per n x m matrix factored at rank r: P = M Q, Q = Mᵀ P and P Qᵀ (2 n m r each) and Q's and P's
    Gram-Schmidt (2 m r², 2 n r²); a tensor sent whole (a bias) costs nothing, nor does a warm-up step."""
    (n, m, r), bias = (64, 32, 4), (16,)
    assert powersgd_plan([(n, m), bias], r) == (16, [(n, m, r)])
    ready, after = compression_work("powersgd", [(n, m), bias], 4, rank=r)
    assert ready == (2 * m * r * r + 2 * n * m * r, 0.0)
    assert after == (2 * n * r * r + 4 * n * m * r, 0.0)
    assert ready[0] + after[0] == 6 * n * m * r + 2 * (n + m) * r * r
    assert compression_work("powersgd", [(n, m)], 4, rank=r, compressing=False) == ((0.0, 0.0), (0.0, 0.0))
    assert compression_work("fp16", [(n, m)], 4) == ((0.0, 0.0), (0.0, 0.0))
    assert compression_work("topk", [(n, m)], 4) == ((0.0, 8 * n * m * 4), (0.0, n * m * 4))


def _step(cfg, step: DataStep) -> float:
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters())
    p = registry.spec_of(cfg).program(cfg, phi, step, False)
    return simulate(p, Cluster.of(p, FAST)).step_s


def _grown(cfg) -> float:
    """How much the config's simulated step grows once the device's rates price its compression."""
    plain = DataStep(0.25, 0.75)
    priced = dataclasses.replace(plain, flops_per_s=FLOPS, memory_bytes_per_s=MEMORY)
    return _step(cfg, priced) - _step(cfg, plain)


@pytest.mark.parametrize("kind, compression", [("ddp", "powersgd"), ("torch_ddp", "powersgd"), ("ddp", "topk")])
def test_a_ddp_step_grows_by_its_compression_work(kind, compression):
    train = {"compression": compression, "steps": 10}
    train.update({"powersgd_rank": 2, "powersgd_warmup_steps": 2} if compression == "powersgd" else {})
    cfg = from_dict({"train": train, "backend": {"kind": kind, "world_size": 4, "bucket_cap_mb": 0.05}})
    buckets = ddp_bucket_shapes(cfg)
    assert len(buckets) > 1
    if compression == "powersgd":
        factored = [f for b in buckets for f in powersgd_plan(b, 2)[1]]
        assert factored
        want = sum(6 * n * m * r + 2 * (n + m) * r * r for n, m, r in factored) / FLOPS
    else:
        want = sum(TOPK_PASSES) * 4 * sum(math.prod(s) for b in buckets for s in b) / MEMORY
    assert _grown(cfg) == pytest.approx(want, rel=1e-6)


def test_a_ps_step_grows_by_its_top_k_selection():
    """Each push's top-k selection, TOPK_PUSH_PASSES over its partition at the memory bandwidth, on every worker."""
    cfg = from_dict({"train": {"compression": "topk", "steps": 10},
                     "backend": {"kind": "ps", "world_size": 2, "servers": 2}})
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters())
    numel = sum(b - a for server in dense_partitions(cfg, phi) for a, b in server)
    assert numel == phi
    assert _grown(cfg) == pytest.approx(TOPK_PUSH_PASSES * 4 * numel / MEMORY, rel=1e-6)
    assert _grown(from_dict({"train": {"compression": "fp16"}, "backend": {"kind": "ps", "world_size": 2}})) == 0


def test_the_device_profiles_price_it():
    """An emulated run's prediction prices the work on its virtual device: peak x mfu FLOP/s and the data sheet's
    memory bandwidth (H100 SXM: 67 TFLOPS fp32, 3.35 TB/s); an unmodelled device leaves it out."""
    h100 = from_dict({"cluster": {"device": "h100", "mfu": 0.5}})
    assert rates(h100) == (67e12 * 0.5, 3350e9)
    assert rates(from_dict({})) == (0.0, 0.0)
