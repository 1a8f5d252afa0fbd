"""On a GPU: DDP, ZeRO, the PS (workers on the GPU, servers on the host) and PyTorch's DDP and FSDP2 on CUDA end
with the CPU `single` reference's model; CUDA peak memory per rank is reported and holds at least the model
states; NCCL at world size 1; two ranks sharing one GPU over gloo.

Skipped (with the reason) where no CUDA device is visible; run them alone with `pytest -m gpu`.
Tolerance: tests/parity.py's (fp32, rtol 1e-4 / atol 1e-5 after 6 steps). CUDA and CPU kernels sum in
different orders (~1e-7 relative per step, as between backends); fp32 matmuls run without TF32 (torch's
default, float32_matmul_precision = "highest"), which would otherwise round inputs to 10 mantissa bits.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity import OPTIMIZERS, assert_same_model, config
from psarch.config import from_dict
from psarch.launch.ranks import run

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none is visible)")]

# (name, backend): world size 1 gets NCCL; two ranks on one GPU must use gloo (NCCL needs a GPU per rank)
CASES = [
    ("ddp-native-nccl-1", {"kind": "ddp", "comm": "native", "world_size": 1, "dist_backend": "nccl"}),
    ("zero3-native-nccl-1", {"kind": "zero", "stage": 3, "comm": "native", "world_size": 1, "dist_backend": "nccl"}),
    ("ddp-ring-gloo-2", {"kind": "ddp", "comm": "ring", "world_size": 2, "dist_backend": "gloo"}),
    ("zero1-native-gloo-2", {"kind": "zero", "stage": 1, "comm": "native", "world_size": 2, "dist_backend": "gloo"}),
    ("zero2-ring-gloo-2", {"kind": "zero", "stage": 2, "comm": "ring", "world_size": 2, "dist_backend": "gloo"}),
    ("zero3-ring-gloo-2", {"kind": "zero", "stage": 3, "comm": "ring", "world_size": 2, "dist_backend": "gloo"}),
    # the parameter server's workers on the GPU, staging through the host to CPU servers
    ("ps-sync-1", {"kind": "ps", "world_size": 1, "servers": 1}),
    ("ps-sync-2-servers2", {"kind": "ps", "world_size": 2, "servers": 2}),
    # PyTorch's own implementations, the peers
    ("torch_ddp-nccl-1", {"kind": "torch_ddp", "world_size": 1, "dist_backend": "nccl"}),
    ("torch_fsdp-nccl-1", {"kind": "torch_fsdp", "world_size": 1, "dist_backend": "nccl"}),
]


def _run(tmp: Path, name: str, backend: dict) -> dict:
    cfg = from_dict(config(name, train=OPTIMIZERS["adamw"], backend=backend))
    return run(cfg, tmp / name, echo=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("gpu")
    _run(tmp, "single-cpu", {"kind": "single", "device": "cpu"})
    return torch.load(tmp / "single-cpu" / "model.pt", weights_only=True), tmp


@pytest.mark.parametrize("name,backend", CASES, ids=[c[0] for c in CASES])
def test_cuda_run_equals_the_cpu_single_reference_and_reports_its_peak(reference, name, backend):
    ref, tmp = reference
    summary = _run(tmp, name, dict(backend, device="cuda"))
    assert_same_model(torch.load(tmp / name / "model.pt", weights_only=True), ref, f"{name} on CUDA vs CPU single")
    predicted = summary["predicted"]["memory_per_rank"]
    assert len(summary["memory"]["per_rank"]) == backend["world_size"]
    for m in summary["memory"]["per_rank"]:
        # the rank's own allocations, on its GPU: at least the model states it holds, as measured and as
        # the formula has them (the peak adds activations and communication buffers on top)
        assert m["peak_kind"] == "cuda_max_allocated", m
        assert m["peak"] >= m["params"] + m["grads"] + m["optimizer"], m
        assert m["peak"] >= predicted["total"], (m, predicted)


def test_bench_step_runs_on_cuda():
    """The step benchmark's CUDA path (NCCL at world size 1, FSDP2 on the GPU) runs and prints ratios."""
    from psarch.bench.step import main

    main(["--device", "cuda", "--steps", "4", "--warmup", "1", "--n-layer", "1", "--n-embd", "32", "--seq-len", "16"])
