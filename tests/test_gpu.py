"""On a GPU: DDP, ZeRO, the PS (workers on the GPU, servers on the host) and PyTorch's DDP and FSDP2 on CUDA end
with the CPU `single` reference's model; CUDA peak memory per rank is reported and holds at least the model
states; NCCL at world size 1; two ranks sharing one GPU over gloo. The fourth wave's paths on CUDA too: DP and
torch.nn.DataParallel (one device), pipeline and tensor parallelism (two ranks on one GPU, gloo), LoRA (SGD, the
CPU `single` with the same adapters within parity.SGD_ATOL), and fp16 compression over NCCL, psarch's against
torch's fp16_compress_hook.

Skipped (with the reason) where no CUDA device is visible; run them alone with `pytest -m gpu`.
Tolerance: tests/parity.py's (fp32, rtol 1e-4 / atol 1e-5 after 6 steps). CUDA and CPU kernels sum in
different orders (~1e-7 relative per step, as between backends); fp32 matmuls run without TF32 (torch's
default, float32_matmul_precision = "highest"), which would otherwise round inputs to 10 mantissa bits.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import json

from parity import OPTIMIZERS, SGD_ATOL, TINY_GPT, assert_same_model, config
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


def _run(tmp: Path, name: str, backend: dict, train: dict = OPTIMIZERS["adamw"], base: dict = TINY_GPT) -> dict:
    cfg = from_dict(config(name, base, train=train, backend=backend))
    return run(cfg, tmp / name, echo=False)


def _model(tmp: Path, name: str) -> dict:
    return torch.load(tmp / name / "model.pt", weights_only=True)


def _holds_its_states(summary: dict, ranks: int) -> None:
    assert len(summary["memory"]["per_rank"]) == ranks
    for m in summary["memory"]["per_rank"]:
        assert m["peak_kind"] == "cuda_max_allocated", m
        assert m["peak"] >= m["params"] + m["grads"] + m["optimizer"], m


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("gpu")
    _run(tmp, "single-cpu", {"kind": "single", "device": "cpu"})
    return _model(tmp, "single-cpu"), tmp


@pytest.mark.parametrize("name,backend", CASES, ids=[c[0] for c in CASES])
def test_cuda_run_equals_the_cpu_single_reference_and_reports_its_peak(reference, name, backend):
    ref, tmp = reference
    summary = _run(tmp, name, dict(backend, device="cuda"))
    assert_same_model(_model(tmp, name), ref, f"{name} on CUDA vs CPU single")
    # the rank's own allocations, on its GPU: at least the model states it holds, as measured and as the formula
    # has them (the peak adds activations and communication buffers on top)
    _holds_its_states(summary, backend["world_size"])
    predicted = summary["predicted"]["memory_per_rank"]
    for m in summary["memory"]["per_rank"]:
        assert m["peak"] >= predicted["total"], (m, predicted)


def test_bench_step_runs_on_cuda():
    """The step benchmark's CUDA path (NCCL at world size 1, FSDP2 on the GPU) runs and prints ratios."""
    from psarch.bench.step import main

    main(["--device", "cuda", "--steps", "4", "--warmup", "1", "--n-layer", "1", "--n-embd", "32", "--seq-len", "16"])


TWO_LAYERS = json.loads(json.dumps(TINY_GPT))
TWO_LAYERS["workload"]["gpt"]["n_layer"] = 2   # a block per pipeline stage
LORA = dict(OPTIMIZERS["sgd"], lora_rank=2, lora_alpha=4.0)
FP16 = dict(OPTIMIZERS["sgd"], compression="fp16")
# (name, train, backend); each against the CPU `single` run with the same train section
WAVE4 = [
    ("dp-1", OPTIMIZERS["adamw"], {"kind": "dp", "world_size": 1}),
    ("torch_dp-1", OPTIMIZERS["adamw"], {"kind": "torch_dp", "world_size": 1}),
    ("pipeline-gloo-2", OPTIMIZERS["adamw"], {"kind": "pipeline", "world_size": 2, "dist_backend": "gloo"}),
    ("tensor-gloo-2", OPTIMIZERS["adamw"], {"kind": "tensor", "world_size": 2, "dist_backend": "gloo"}),
    ("ddp-lora-nccl-1", LORA, {"kind": "ddp", "world_size": 1, "dist_backend": "nccl"}),
    ("zero3-lora-gloo-2", LORA, {"kind": "zero", "stage": 3, "comm": "ring", "world_size": 2, "dist_backend": "gloo"}),
]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("gpu4")
    for name, train in (("single-adamw", OPTIMIZERS["adamw"]), ("single-lora", LORA)):
        _run(tmp, name, {"kind": "single", "device": "cpu"}, train, TWO_LAYERS)
    return tmp


@pytest.mark.parametrize("name,train,backend", WAVE4, ids=[c[0] for c in WAVE4])
def test_the_fourth_waves_backends_on_cuda_equal_the_cpu_reference(references, name, train, backend):
    tmp = references
    summary = _run(tmp, name, dict(backend, device="cuda"), train, TWO_LAYERS)
    ref, tol = ("single-lora", {"rtol": 0, "atol": SGD_ATOL}) if train is LORA else ("single-adamw", {})
    assert_same_model(_model(tmp, name), _model(tmp, ref), f"{name} on CUDA vs CPU single", **tol)
    _holds_its_states(summary, backend["world_size"])


def test_fp16_compression_over_nccl_equals_torchs_hook(tmp_path):
    """psarch's cast, all-reduce and cast back over NCCL against torch DDP's fp16_compress_hook, both on CUDA."""
    for name, kind in (("ddp-fp16", "ddp"), ("torch_ddp-fp16", "torch_ddp")):
        _run(tmp_path, name, {"kind": kind, "world_size": 1, "dist_backend": "nccl", "device": "cuda"}, FP16)
    assert_same_model(_model(tmp_path, "ddp-fp16"), _model(tmp_path, "torch_ddp-fp16"), "fp16 psarch vs torch hook",
                      rtol=0, atol=SGD_ATOL)


# (name, train, backend): the same config on the CPU and on CUDA ends with the same model (SGD, parity.SGD_ATOL)
SAME = [
    # GEO's compressed pulls: each worker adds its pulled deltas to a CUDA model, the servers to their fp32 copies
    # (top-k of every element: which elements a ratio below 1 picks may differ where CUDA's sums round otherwise)
    ("ps-geo-topk-2", dict(OPTIMIZERS["sgd"], compression="topk", topk_ratio=1.0),
     {"kind": "ps", "mode": "geo", "geo_barrier": True, "k_steps": 2, "world_size": 2, "servers": 1}),
    # FSDP2 with LoRA: the frozen base sharded beside the adapters
    ("torch_fsdp-lora-1", LORA, {"kind": "torch_fsdp", "world_size": 1}),
]


@pytest.mark.parametrize("name,train,backend", SAME, ids=[c[0] for c in SAME])
def test_a_config_on_cuda_ends_as_on_the_cpu(tmp_path, name, train, backend):
    for device in ("cpu", "cuda"):
        _run(tmp_path, f"{name}-{device}", dict(backend, device=device), train, TWO_LAYERS)
    assert_same_model(_model(tmp_path, f"{name}-cuda"), _model(tmp_path, f"{name}-cpu"), f"{name}: CUDA vs CPU",
                      rtol=0, atol=SGD_ATOL)
