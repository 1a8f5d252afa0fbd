"""The `ps` backend's worker: computes gradients, pushes them to the servers, pulls parameters back.

A worker holds the model's parameters and gradients only; the optimizer runs on the servers (in GEO
each worker also runs a local optimizer, as in PaddlePaddle's GEO-SGD). Parameters and gradients live
in one flat buffer (`FlatParams`); server i owns the contiguous slice `ranges[i]` of it.

Precision: workers compute in the compute dtype and push gradients (GEO: deltas) in it; servers keep
fp32 parameters and optimizer state, and answer pulls in the compute dtype. So the wire carries
S = Φ·bytes(compute dtype) each way, as theory.traffic_per_step assumes. In fp16 the loss scale is
the servers' (sent with every pull); the worker checks its whole gradient for inf/nan and sends the
verdict with the push, so that every server skips the same steps.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from psarch.checkpoint import Checkpoint, Pieces
from psarch.config import Config
from psarch.dist import DistContext
from psarch.errors import check_loss
from psarch.flat import FlatParams
from psarch.meters import peak_memory, tensor_bytes
from psarch.precision import MixedPrecisionOptimizer, compute_dtype, has_inf_or_nan
from psarch.ps import wire
from psarch.ps.client import PSClient, Request
from psarch.ps.layout import server_ranges, state_from_flat, trainable
from psarch.ps.snapshot import restore_worker, save_worker, shapes, worker_pieces
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.workload import Workload



class PSTrainer(Trainer):
    """One PS worker (modes sync, async, ssp, geo; see psarch/ps/server.py for what servers do)."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        b = cfg.backend
        self.cfg, self.ctx, self.mode, self.n = cfg, ctx, b.mode, b.world_size
        self.dtype = compute_dtype(cfg.train.precision)
        self.fp16 = cfg.train.precision == "fp16"
        self.model = workload.model.to(ctx.device, self.dtype)
        self.loss_fn = workload.loss_fn
        self.flat = FlatParams(trainable(self.model))
        addresses = list(ctx.services.addresses or b.server_addresses)
        if len(addresses) != b.servers:
            raise RuntimeError(f"backend.servers = {b.servers}: {len(addresses)} server address(es) known "
                               f"({addresses}); run through `psarch run`, or list every server in "
                               f"backend.server_addresses")
        self.ranges = server_ranges(self.flat.numel, b.servers)
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.layout = [(names[id(p)], p.shape, o) for p, o in zip(self.flat.params, self.flat.offsets)]
        self.param_shapes = shapes(self.layout)   # every parameter a checkpoint holds (rows: the tables too)
        self.client = PSClient(addresses, ctx.rank, b.timeout_s, ctx.services.auth, b.heartbeat_s,
                               b.heartbeat_timeout_s)
        self.wire_dtype = wire.DTYPE_NAMES[self.dtype]
        # the wire is host memory: a GPU worker stages parameters there
        self.host = self.flat.data if ctx.device.type == "cpu" else torch.empty_like(self.flat.data, device="cpu")
        self.versions = [0] * b.servers
        self.loss_scale = 1.0
        self.steps = 0        # steps taken
        self.rounds = 0       # geo: deltas pushed
        if not ctx.services.restored:   # else load_checkpoint sets the state
            self._pull_only(0)  # the servers built the same initial model from the config: nothing to send
        self.local = self.synced = None
        if self.mode == "geo":
            self.local = MixedPrecisionOptimizer([self.flat.data], cfg.train, cfg.train.precision)
            self.synced = self.local.master.masters[0].detach().float().clone()   # the last pulled model

    # ------------------------------------------------------------------ wire

    def _exchange(self, pushed: torch.Tensor | None, step: int, header: dict[str, Any],
                  before: list[Request] | None = None) -> dict[str, Any]:
        """Push `pushed`'s slices (if given) and pull the parameters for `step` from every server, in
        parallel, one `pushpull` request per server (after `before[i]`, if given); the parameters land
        in the flat buffer. Returns what the replies said."""
        t0 = time.perf_counter()
        reqs = [Request({"op": "pull", "step": step, "want": self.wire_dtype}, into=self.host[lo:hi])
                if pushed is None else
                Request(dict(header, op="pushpull", step=step - 1, version=self.versions[i], offset=lo),
                        pushed[lo:hi], into=self.host[lo:hi])
                for i, (lo, hi) in enumerate(self.ranges)]
        self.client.exchange([[r] if before is None else [before[i], r] for i, r in enumerate(reqs)])
        if self.host is not self.flat.data:
            self.flat.data.copy_(self.host, non_blocking=False)
        replies = [r.reply for r in reqs]
        self.versions = [p["version"] for p in replies]
        self.loss_scale = min(p.get("scale", 1.0) for p in replies)
        out: dict[str, Any] = {"comm_s": time.perf_counter() - t0, "version": self.versions[0],
                               "skipped": any(p.get("skipped", False) for p in replies)}
        for key in ("staleness", "ahead"):
            values = [p[key] for p in replies if key in p]
            if values:
                out[key] = max(values)
        return out

    def _pull_only(self, step: int) -> None:
        self._exchange(None, step, {})

    # ------------------------------------------------------------------ steps

    def step(self, batch: Any) -> StepStats:
        t_start = time.time()
        self.flat.zero_grad()
        loss = self.loss_fn(self.model, batch)
        if not self.fp16:  # before the push: name the bad loss rather than have a server refuse its gradient
            check_loss(self.steps, self.ctx.rank, float(loss.detach()))
        if self.mode == "geo":
            return self._geo_step(loss, t_start)
        (loss * self.loss_scale if self.fp16 else loss).backward()
        header: dict[str, Any] = {}
        if self.fp16:
            header = {"scale": self.loss_scale, "found_inf": bool(has_inf_or_nan([self.flat.grad]).item())}
        self.steps += 1
        info = self._exchange(self.flat.grad, self.steps, header)
        return self._stats(loss, info, t_start)

    def _geo_step(self, loss: torch.Tensor, t_start: float) -> StepStats:
        self.local.scaler.scale_loss(loss).backward()
        skipped = self.local.step([self.flat.grad])
        self.steps += 1
        info: dict[str, Any] = {"comm_s": 0.0, "skipped": skipped}
        if self.steps % self.cfg.backend.k_steps == 0:
            info.update(self._geo_round(), skipped=skipped)
        return self._stats(loss, info, t_start, self.local.scaler.scale)

    def _geo_round(self) -> dict[str, Any]:
        """Push delta = (local − last synced) / N, pull the servers' model and continue from it."""
        master = self.local.master.masters[0].detach()
        delta = ((master - self.synced) / self.n).to(self.dtype)
        self.rounds += 1
        info = self._exchange(delta, self.rounds, {})
        with torch.no_grad():
            if self.local.master.copies:
                master.copy_(self.flat.data)   # pulled in the compute dtype
            self.synced.copy_(master)
        return info

    def _stats(self, loss: torch.Tensor, info: dict[str, Any], t_start: float, scale: float | None = None) -> StepStats:
        extra = {k: info[k] for k in ("version", "staleness", "ahead") if k in info}
        extra.update(t_start=t_start, t_end=time.time())
        return StepStats(float(loss.item()), skipped=bool(info.get("skipped", False)),
                         loss_scale=scale if scale is not None else self.loss_scale,
                         comm_s=info.get("comm_s", 0.0), extra=extra)

    # ------------------------------------------------------------------ protocol

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0: the servers' fp32 parameters (after GEO's last partial round). Every rank then tells
        the servers it is done."""
        if self.mode == "geo" and self.steps % self.cfg.backend.k_steps:
            self._geo_round()
        state: dict[str, torch.Tensor] = {}
        if self.ctx.rank == 0:
            final = torch.empty(self.flat.numel, dtype=torch.float32)
            self.client.exchange([[Request({"op": "fetch"}, into=final[lo:hi])] for lo, hi in self.ranges])
            state = state_from_flat(self.model, final)
        self.client.exchange([[Request({"op": "done"})] for _ in self.ranges])
        return state

    def checkpoint_pieces(self, writing: bool = True) -> Pieces:
        """This worker's part of a checkpoint (the servers write the parameters and optimizer state)."""
        return worker_pieces(self)

    def write_checkpoint(self, ctx: DistContext, root: Path, step: int, config: dict[str, Any], keep: int,
                         rows: list[dict[str, Any]] | None) -> Path:
        return save_worker(self, root, step, config, keep, rows)

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        restore_worker(self, ckpt)

    def memory(self) -> MemoryReport:
        peak, kind = peak_memory(self.ctx.device)
        # a GPU worker's host staging copy for the wire is host memory, not model state on the device
        return MemoryReport(params=tensor_bytes([self.flat.data]), grads=tensor_bytes([self.flat.grad]),
                            optimizer=self.local.state_bytes() if self.local is not None else 0,
                            buffers=tensor_bytes([self.synced]), peak=peak, peak_kind=kind)

    def traffic(self) -> TrafficReport:
        return self.client.meter.report()

    def summary_extra(self) -> dict[str, Any]:
        return {"ps_versions": list(self.versions)}

    def close(self) -> None:
        self.client.close()
