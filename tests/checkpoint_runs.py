"""The runs test_checkpoint.py looks at, one spawned process group per world size (start-up is the cost):
N=4 writes a ZeRO-3 checkpoint; N=2 checks bit-exact resume of ddp, zero 1-3 and the torch DDP, ZeRO-1 and FSDP2
peers (fp32, fp16 with its loss scaler, and dropout with each rank's generator) and forks the N=4 checkpoint onto
ddp, FSDP2 and ps sync with 2 servers; N=3 forks a ZeRO-1 N=2 checkpoint onto ZeRO-3. Also the configs and TOML
the CLI tests run."""
from __future__ import annotations

import json
from pathlib import Path

import torch

import parity
from parity import OPTIMIZERS
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.records import ServiceInfo
from psarch.launch.runner import run_rank
from zero_runs import TINY_GPT

ZERO = {"kind": "zero", "reduce_bucket_size": 600, "allgather_bucket_size": 1500, "prefetch_bucket_size": 1500}
BACKENDS = {"ddp-ring": {"kind": "ddp", "comm": "ring"}, "ddp-native": {"kind": "ddp", "comm": "native"},
            **{f"zero{s}": dict(ZERO, stage=s) for s in (1, 2, 3)}, "torch_ddp": {"kind": "torch_ddp"},
            "torch_zero": {"kind": "torch_zero"}, "torch_fsdp": {"kind": "torch_fsdp"}}
FP32_ONLY = ("torch_zero", "torch_fsdp")   # PyTorch's ZeRO peers run fp32 only
RESUMED = [f"{b}-{p}" for b in BACKENDS for p in ("fp32", "fp16") if p == "fp32" or b not in FP32_ONLY]
RESUMED.append("ddp-ring-dropout")   # fp32 with dropout: each rank's generator is carried
ROW_KEYS = ("step", "loss", "skipped", "loss_scale")


def config(name: str, precision: str, backend: dict, n: int, **train) -> dict:
    """fp32: the two-block tiny GPT under AdamW; fp16: a regression whose gradients overflow at steps 2 and
    3, so the loss scaler's hysteresis and scale both matter across a checkpoint at step 3; "dropout": fp32
    regression through dropout, each rank's generator on its own stream (factories.dropout_regression)."""
    if precision == "dropout":
        return parity.config(name, workload={"factory": "factories:dropout_regression"},
                             train=dict(OPTIMIZERS["adamw"], global_batch=8, **train),
                             backend=dict(backend, world_size=n))
    if precision == "fp16":
        backend = dict(backend, zero_units="") if backend["kind"] == "zero" else backend
        return parity.config(name, TINY_GPT, workload={"factory": "factories:overflow_on_steps_2_and_3"},
                             train=dict(OPTIMIZERS["sgd"], lr=0.05, precision="fp16", global_batch=8, **train),
                             backend=dict(backend, world_size=n))
    return parity.config(name, TINY_GPT, train=dict(OPTIMIZERS["adamw"], **train), backend=dict(backend, world_size=n))


def regression(name: str, backend: dict | None = None, **train) -> dict:
    """A regression (factories.hangs_at_step: a test may stop it) of 8 AdamW steps, a checkpoint every 2."""
    return parity.config(name, workload={"factory": "factories:hangs_at_step"}, backend=backend or {},
                         train=dict(OPTIMIZERS["adamw"], **{"steps": 8, "checkpoint_every": 2, **train}))


def toml(path: Path, data: dict) -> Path:
    """`data` (a config dict) written as a TOML file at `path`, for the CLI."""
    def value(v):
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()
    lines = [f"name = {json.dumps(data['name'])}", f"seed = {data['seed']}"]
    for section in ("workload", "train", "backend"):
        lines.append(f"[{section}]")
        lines += [f"{k} = {value(v)}" for k, v in data.get(section, {}).items() if not isinstance(v, dict)]
        for sub, vals in data.get(section, {}).items():
            if isinstance(vals, dict):
                lines.append(f"[{section}.{sub}]")
                lines += [f"{k} = {value(v)}" for k, v in vals.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(rank: int, n: int, data: dict, out: Path, checkpoints: Path | None = None, start: Path | None = None,
         resume: bool = False, services: ServiceInfo | dict | None = None, keys: tuple[str, ...] = ROW_KEYS) -> dict:
    ctx = DistContext(rank, n, rank, torch.device("cpu"), "gloo")
    ctx.services = services if isinstance(services, ServiceInfo) else ServiceInfo.from_dict(services)
    record = run_rank(from_dict(data), ctx, echo=False, checkpoints=checkpoints, start=start, resume=resume)
    if rank == 0:
        torch.save(record.model_state, out / f"{data['name']}.pt")
    return {"rows": [{k: r.get(k) for k in keys} for r in record.steps]}


def straight_and_resumed(rank: int, n: int, out: Path, name: str, precision: str, backend: dict) -> dict:
    """6 steps straight with a checkpoint every 3; then from the step-3 checkpoint, resumed, to step 6."""
    ckpts = out / name / "checkpoints"
    straight = _run(rank, n, config(name, precision, backend, n, steps=6, checkpoint_every=3), out, ckpts)
    resumed = _run(rank, n, config(f"{name}-resumed", precision, backend, n, steps=6), out,
                   start=ckpts / "step_000003", resume=True)
    return {"straight": straight["rows"], "resumed": resumed["rows"]}


def world4(rank: int, n: int, out: str) -> dict:
    o = Path(out)
    _run(rank, n, config("z3n4", "fp32", dict(ZERO, stage=3), n, steps=6, checkpoint_every=3), o, o / "z3n4")
    return {}


def to_ps2() -> dict:
    """The N=4 ZeRO-3 checkpoint continued as ps sync, two workers and two servers (threads of the test)."""
    return config("z3n4-to-ps2", "fp32", {"kind": "ps", "world_size": 2, "servers": 2, "timeout_s": 60.0}, 2, steps=6)


def world2(rank: int, n: int, out: str, ps_info: dict) -> dict:
    o = Path(out)
    results = {}
    for name in RESUMED:
        backend, _, precision = name.rpartition("-")
        results[name] = straight_and_resumed(rank, n, o, name, precision, BACKENDS[backend])
    for fork in ("ddp-ring", "torch_fsdp"):
        _run(rank, n, config(f"z3n4-to-{fork}2", "fp32", BACKENDS[fork], n, steps=6), o,
             start=o / "z3n4" / "step_000003")
    _run(rank, n, to_ps2(), o, start=o / "z3n4" / "step_000003", services=ps_info)
    return results


def world3(rank: int, n: int, out: str) -> dict:
    o = Path(out)
    _run(rank, n, config("z1n2-to-z3n3", "fp32", dict(ZERO, stage=3), n, steps=6), o,
         start=o / "zero1-fp32" / "checkpoints" / "step_000003")
    return {}


def single(out: Path, name: str, start: Path) -> dict[str, torch.Tensor]:
    """The single-process continuation from a checkpoint to step 6: the reference a fork is checked against."""
    data = config(name, "fp32", {"kind": "single"}, 1, steps=6)
    record = run_rank(from_dict(data), DistContext(), echo=False, start=start)
    return record.model_state
