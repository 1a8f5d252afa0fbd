"""The runs every ZeRO test looks at: each stage, communicator, optimizer and precision at N = 2 and 3,
psarch DDP and PyTorch's peers beside them, each ZeRO trainer watched from outside by a Probe; run by
test_zero.py's `runs` fixture, in one spawned process group per world size."""
from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import torch

import parity
from parity import OPTIMIZERS
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.meters import tensor_bytes
from psarch.trainer import load_trainer
from psarch.launch.runner import run_rank
from psarch.workload import build_workload

TINY_GPT = json.loads(json.dumps(parity.TINY_GPT))
TINY_GPT["workload"]["gpt"]["n_layer"] = 2   # two blocks: ZeRO-3 gathers unit by unit
ZERO = {"kind": "zero", "reduce_bucket_size": 600, "allgather_bucket_size": 1500, "prefetch_bucket_size": 1500}
STAGES = (1, 2, 3)
COMMS = ("ring", "native")


def overflow_in_one_chunk(cfg):
    """fp16 regression whose gradient overflows at steps 3 and 4 in one element only (the output bias),
    which after the reduce-scatter lies in a single rank's chunk: only a global inf check skips on all."""
    from factories import regression

    wl = regression(cfg, scale=1e-3)
    calls, extra = {"n": 0}, {}

    def add_term(module, args, out):  # inside forward, where ZeRO-3 has the parameter gathered
        if calls["n"] in (4, 5):      # d/d(bias) = 1e5, times the 2^16 loss scale: inf in fp16, nothing else
            extra["term"] = 1e5 * module.bias.float().sum()

    wl.model.net[2].register_forward_hook(add_term)

    def loss_fn(model, b):
        calls["n"] += 1
        extra.clear()
        loss = wl.loss_fn(model, b)
        return loss + extra["term"] if "term" in extra else loss

    return type(wl)(wl.model, loss_fn, wl.batch, wl.entropy_floor, "overflow-one-chunk")


def config(name: str, **sections) -> dict:
    return parity.config(name, TINY_GPT, **sections)


class Probe:
    """Watches a ZeroTrainer from outside, through the tensors it holds and the collectives it issues
    (not through the engine's own byte counters, which a regression could get wrong together with the
    buffers they count):
    - stage 2: right after each gradient hook, p.grad must be None (the full gradient is dropped at
      once), and the gradient buckets held (filling or being reduced) are measured;
    - stage 3: after each step every parameter's storage is empty (0 bytes: only the shard stays), and
      inside each module's backward (a backward pre-hook) the storage of its parameters is the full unit;
    - asynchronous reduce-scatters issued inside backward (from autograd hooks): the overlap;
    - the largest buffer all-gathered during full_state_dict (the export's peak)."""

    def __init__(self, trainer) -> None:
        self.trainer, self.stage = trainer, trainer.stage
        self.grads_kept = 0            # stage 2: gradients found alive after their hook
        self.bucket_peak = 0           # stage 2: bytes of gradient buckets held, peak over hooks
        self.held_after_step = 0       # stage 3: parameter storage bytes found after a step, summed
        self.backward_checks = 0       # stage 3: parameters seen inside their module's backward
        self.backward_not_full = 0     # ... whose unit was not fully gathered there
        self.async_rs_in_backward = 0
        self.export_gather_peak = 0
        self._exporting = False
        comm, step, export = trainer.comm, trainer.step, trainer.full_state_dict
        reduce_scatter, all_gather = comm.reduce_scatter, comm.all_gather

        def counted_reduce_scatter(output, input, async_op=False):
            if async_op and torch._C._current_autograd_node() is not None:
                self.async_rs_in_backward += 1
            return reduce_scatter(output, input, async_op=async_op)

        def measured_all_gather(output, input, async_op=False):
            if self._exporting:
                self.export_gather_peak = max(self.export_gather_peak, output.numel() * output.element_size())
            return all_gather(output, input, async_op=async_op)

        def checked_step(batch):
            stats = step(batch)
            if trainer.stage == 3:
                self.held_after_step += sum(p.untyped_storage().nbytes() for p in trainer.params)
            return stats

        def measured_export():
            self._exporting = True
            try:
                return export()
            finally:
                self._exporting = False

        comm.reduce_scatter, comm.all_gather = counted_reduce_scatter, measured_all_gather
        trainer.step, trainer.full_state_dict = checked_step, measured_export
        if trainer.stage == 2:  # registered after the engine's hooks, so these run right after them
            for p in trainer.params:
                p.register_post_accumulate_grad_hook(self._after_grad_hook)
        if trainer.stage == 3:
            for m in trainer.model.modules():
                if any(True for _ in m.parameters(recurse=False)):
                    m.register_full_backward_pre_hook(self._in_backward)

    def _after_grad_hook(self, p: torch.Tensor) -> None:
        e = self.trainer.engine
        self.grads_kept += p.grad is not None
        held = list(e._held.values())
        self.bucket_peak = max(self.bucket_peak, tensor_bytes(held))

    def _in_backward(self, module, grad_output) -> None:
        e = self.trainer.engine
        for p in module.parameters(recurse=False):
            g = e._group_of[id(p)]
            self.backward_checks += 1
            self.backward_not_full += p.untyped_storage().nbytes() != g.padded * p.element_size()

    def report(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and k != "trainer"}


def train(rank: int, n: int, data: dict, out: str) -> dict:
    """Run one config on this rank inside the existing process group; rank 0 saves the model. A ZeRO
    trainer runs under a Probe, whose findings come back as "probe"."""
    cfg = from_dict(data)
    probes = []

    def probed(kind):
        cls = load_trainer(kind)
        if kind != "zero":
            return cls

        def build(*args):
            trainer = cls(*args)
            probes.append(Probe(trainer))
            return trainer
        return build

    with mock.patch("psarch.trainer.load_trainer", probed):
        record = run_rank(cfg, DistContext(rank, n, rank, torch.device("cpu"), "gloo"), echo=False)
    if rank == 0:
        torch.save(record.model_state, Path(out) / f"{cfg.name}.pt")
    return {"traffic": record.traffic, "memory": record.memory, "params": record.params,
            "extra": record.extra, "probe": probes[0].report() if probes else None,
            "rows": [{**{k: r[k] for k in ("loss", "sent", "received", "skipped", "loss_scale")},
                      "saved_activation_bytes": r["extra"].get("saved_activation_bytes")} for r in record.steps]}


def resume(rank: int, n: int, stage: int, precision: str, out: Path) -> dict:
    """Train 3 steps, write a checkpoint, train 3 more; a fresh trainer loaded from the checkpoint and
    trained the same 3 steps must end bitwise equal, with the same loss-scaler state (fp16: scale,
    clean-step count, hysteresis). Returns the largest difference (rank 0) and both scaler states."""
    from psarch import checkpoint
    from zero.trainer import ZeroTrainer

    cfg = from_dict(config("resume", train=dict(OPTIMIZERS["adamw"], precision=precision),
                           backend=dict(ZERO, stage=stage, world_size=n)))
    ctx = DistContext(rank, n, rank, torch.device("cpu"), "gloo")
    root = out / f"resume-{n}-{stage}-{precision}"
    finals, scalers = [], []
    for fresh in (False, True):
        wl = build_workload(cfg)
        trainer = ZeroTrainer(wl, cfg, ctx)
        if fresh:
            ckpt = checkpoint.Checkpoint(root / "step_000003")
            trainer.load_checkpoint(ckpt)
            ckpt.close()
        else:
            for step in range(3):
                trainer.step(wl.batch(step, rank, n))
            checkpoint.save(trainer.checkpoint_pieces(), ctx, root, 3, cfg.to_dict())
        for step in range(3, 6):
            trainer.step(wl.batch(step, rank, n))
        finals.append(trainer.full_state_dict())
        scalers.append(trainer.optim.scaler.state_dict())
        trainer.close()
    diff = max(((a - finals[1][k]).abs().max().item() for k, a in finals[0].items()), default=0.0)
    return {"diff": diff, "scalers": scalers}


def all_variants(rank: int, n: int, out: str) -> dict:
    results = {}
    precisions = ("fp32", "bf16", "fp16") if n == 2 else ("fp32", "fp16")
    results[f"resume-{n}"] = {f"{stage}-{precision}": resume(rank, n, stage, precision, Path(out))
                         for stage in STAGES for precision in precisions}
    for opt, hp in OPTIMIZERS.items():
        results[f"ddp-{opt}-{n}"] = train(rank, n, config(f"ddp-{opt}-{n}", train=hp,
                                                          backend={"kind": "ddp", "world_size": n}), out)
        for stage in STAGES:
            for comm in COMMS:
                name = f"zero{stage}-{comm}-{opt}-{n}"
                measured = comm == "ring" and opt == "adamw"   # saved activations: only where asked for
                results[name] = train(rank, n, config(name, train=hp, backend=dict(
                    ZERO, stage=stage, comm=comm, world_size=n, measure_activations=measured)), out)
        for peer in ("torch_zero", "torch_fsdp"):
            results[f"{peer}-{opt}-{n}"] = train(rank, n, config(f"{peer}-{opt}-{n}", train=hp,
                                                                 backend={"kind": peer, "world_size": n}), out)
    if n == 3:  # mixed precision where groups do not divide by N: padding in every category
        for stage in STAGES:
            results[f"bf16-{stage}-n3"] = train(rank, n, config(
                f"bf16-{stage}-n3", train=dict(OPTIMIZERS["adamw"], precision="bf16"),
                backend=dict(ZERO, stage=stage, world_size=n)), out)
    if n == 2:
        adamw = OPTIMIZERS["adamw"]
        plain = {"overlap_comm": False, "reduce_bucket_size": 10**6, "prefetch_bucket_size": 0}
        for stage in STAGES:
            results[f"plain{stage}"] = train(rank, n, config(f"plain{stage}", train=adamw, backend=dict(
                ZERO, stage=stage, world_size=n, **plain)), out)
        for stage in (2, 3):
            results[f"ckpt{stage}"] = train(rank, n, config(f"ckpt{stage}", train=adamw, backend=dict(
                ZERO, stage=stage, world_size=n, activation_checkpointing=True, measure_activations=True)), out)
        for stage in STAGES:
            for precision in ("bf16", "fp16"):
                results[f"{precision}-{stage}"] = train(rank, n, config(
                    f"{precision}-{stage}", train={"optimizer": "adamw", "lr": 1e-2, "steps": 40, "precision": precision},
                    workload={"model": "mlp"}, backend=dict(ZERO, stage=stage, world_size=n)), out)
            results[f"overflow-{stage}"] = train(rank, n, config(
                f"overflow-{stage}", train={"optimizer": "sgd", "lr": 0.05, "steps": 6, "precision": "fp16",
                                            "global_batch": 8},
                workload={"factory": "zero_runs:overflow_in_one_chunk"},
                backend={"kind": "zero", "stage": stage, "world_size": n}), out)
    return results
