"""The `dp` backend: torch.nn.DataParallel's step, written out (torch/nn/parallel/data_parallel.py: replicate,
scatter, parallel_apply, gather), so every copy to and from the master device is counted where it is made.

The master is the `single` trainer on the first device (its model, flat buffers, optimizer and checkpoints);
device i > 0 holds a replica. A step: the master's trainable parameters copied to every replica (replicate),
the global batch cut along its first dimension, shard i copied to device i (scatter), each device's forward in
its own thread (parallel_apply; the workload's loss function is the module's output, as under DataParallel a
model that returns its loss), the losses copied to the master, which averages them (gather), each device's
backward in its thread from the master's gradient 1/N (gather's backward), the replicas' gradients copied to
the master and summed (replicate's backward, ReduceAddCoalesced), the optimizer step on the master. As in
torch's replicate, the master's own replica is the master: N - 1 copies each way.
"""
from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch

from psarch.config import Config
from psarch.dist import DistContext
from psarch.flat import FlatParams
from psarch.meters import TrafficMeter, flat_memory, tensor_bytes
from psarch.precision import compute_dtype
from psarch.single import SingleTrainer
from psarch.trainer import MemoryReport, StepStats, TrafficReport
from psarch.workload import Workload


def dp_devices(device: torch.device, n: int) -> list[torch.device]:
    """One device per worker thread: n CUDA devices from cuda:0, or the CPU n times (threads on its cores)."""
    if device.type != "cuda":
        return [device] * n
    if torch.cuda.device_count() < n:
        raise RuntimeError(f"backend.world_size = {n}: backend.kind = \"dp\" on CUDA runs one device per worker, "
                           f"and {torch.cuda.device_count()} are visible; use backend.device = \"cpu\" or fewer workers")
    return [torch.device("cuda", i) for i in range(n)]


def scatter(batch: Any, devices: list[torch.device]) -> list[Any]:
    """The batch cut in len(devices) equal parts along the first dimension of each tensor (of a tuple, list or
    dict too), part i on devices[i]."""
    n = len(devices)
    if torch.is_tensor(batch):
        return [c.to(d) for c, d in zip(batch.chunk(n), devices)]
    if isinstance(batch, (tuple, list)):
        return [type(batch)(parts) for parts in zip(*(scatter(b, devices) for b in batch))]
    if isinstance(batch, dict):
        cut = {k: scatter(v, devices) for k, v in batch.items()}
        return [{k: cut[k][i] for k in batch} for i in range(n)]
    return [batch] * n   # not a tensor: every device reads the same value


def batch_bytes(batch: Any) -> int:
    """Bytes of the tensors in a (possibly nested) batch."""
    if torch.is_tensor(batch):
        return batch.numel() * batch.element_size()
    if isinstance(batch, (tuple, list)):
        return sum(batch_bytes(b) for b in batch)
    if isinstance(batch, dict):
        return sum(batch_bytes(b) for b in batch.values())
    return 0


class Replica:
    """A copy of the master's module on one device; its trainable parameters in one flat buffer, which the
    master's are copied into each step. Frozen parameters and buffers are copied once here: they never change."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.model = copy.deepcopy(model).to(device, dtype)
        self.flat = FlatParams([p for p in self.model.parameters() if p.requires_grad])


class DPTrainer(SingleTrainer):
    """One process, one thread per device; the master (the first device) computes the loss and updates."""

    def __init__(self, workload: Workload, cfg: Config, ctx: DistContext) -> None:
        n = cfg.backend.world_size
        self.devices = dp_devices(ctx.device, n)
        dtype = compute_dtype(cfg.train.precision)
        # replicated before the master flattens its parameters (a deep copy of flat views would share nothing
        # useful), from the same initial model
        self.replicas = [Replica(workload.model, d, dtype) for d in self.devices[1:]]
        super().__init__(workload, cfg, ctx)
        self.modules = [self.model, *(r.model for r in self.replicas)]
        self.meter = TrafficMeter()
        self.pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="psarch-dp")

    def _on(self, i: int) -> Any:
        d = self.devices[i]
        return torch.cuda.device(d) if d.type == "cuda" else nullcontext()

    def _forward(self, i: int, shard: Any) -> torch.Tensor:
        with self._on(i):
            return self.loss_fn(self.modules[i], shard)

    def _backward(self, i: int, loss: torch.Tensor) -> None:
        with self._on(i):
            # the master's loss is the mean of the N losses: each device's gradient from it is 1/N (scaled)
            self.optim.scaler.scale_loss(loss / len(self.devices)).backward()

    def step(self, batch: Any) -> StepStats:
        n, master = len(self.devices), self.devices[0]
        self.flat.zero_grad()
        s = tensor_bytes([self.flat.data])
        for r in self.replicas:   # replicate
            r.flat.data.copy_(self.flat.data)
            r.flat.zero_grad()
            self.meter.add("replicate", s, 0)
        shards = scatter(batch, self.devices)
        for shard in shards[1:]:
            self.meter.add("scatter", batch_bytes(shard), 0)
        losses = list(self.pool.map(self._forward, range(n), shards))   # parallel_apply
        gathered = [x.detach().to(master) for x in losses]
        for x in losses[1:]:
            self.meter.add("gather", 0, batch_bytes(x))
        loss = torch.stack(gathered).float().mean()
        for x in losses[1:]:   # gather's backward: the gradient of each output, sent to its device
            self.meter.add("gather_grad", batch_bytes(x), 0)
        list(self.pool.map(self._backward, range(n), losses))
        for r in self.replicas:   # replicate's backward: the replicas' gradients summed on the master
            self.flat.grad.add_(r.flat.grad.to(master))
            self.meter.add("reduce", 0, tensor_bytes([r.flat.grad]))
        skipped = self.optim.step([self.flat.grad])
        return StepStats(float(loss.item()), skipped=skipped, loss_scale=self.optim.scaler.scale)

    def memory(self) -> MemoryReport:
        """The master's model states plus every replica's parameters and gradients, and every device's copy of
        the frozen parameters."""
        m = flat_memory(self.ctx.device, self.flat, self.optim.state_bytes())
        m.params += tensor_bytes(r.flat.data for r in self.replicas)
        m.grads += tensor_bytes(r.flat.grad for r in self.replicas)
        m.frozen = tensor_bytes(p for module in self.modules for p in module.parameters() if not p.requires_grad)
        return m

    def traffic(self) -> TrafficReport:
        return self.meter.report()

    def summary_extra(self) -> dict[str, Any]:
        return {"devices": [str(d) for d in self.devices]}

    def close(self) -> None:
        self.pool.shutdown()
