"""User-style workload factories the tests name through `workload.factory = "factories:..."`."""
from __future__ import annotations

import textwrap

import torch
import torch.nn.functional as F
from torch import nn

import psarch
from psarch.data import shard_batch, step_generator


class TinyRegressor(nn.Module):
    """A user's own model, unlike anything built in."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def regression(cfg, scale: float = 1.0) -> psarch.Workload:
    """Noisy linear regression: the best achievable MSE is the noise variance (0.01 * scale^2)."""
    w_true = torch.linspace(-1, 1, 6) * scale
    global_batch = cfg.train.global_batch

    def batch(step: int, shard: int, num_shards: int):
        g = step_generator(cfg.seed, step)
        x = torch.randn(global_batch, 6, generator=g)
        y = x @ w_true + 0.1 * scale * torch.randn(global_batch, generator=g)
        return shard_batch(x, shard, num_shards), shard_batch(y, shard, num_shards)

    def loss_fn(model: nn.Module, b) -> torch.Tensor:
        x, y = b
        return F.mse_loss(model(x.to(next(model.parameters()).dtype)).squeeze(-1).float(), y.float())

    return psarch.Workload(TinyRegressor(), loss_fn, batch, entropy_floor=0.01 * scale**2, name="regression")


def overflow_at_steps_3_and_4(cfg) -> psarch.Workload:
    """Small-valued regression (fp16 gradients fit under a 2^16 loss scale) whose loss at steps 3 and 4
    is blown up so that fp16 gradients overflow."""
    wl = regression(cfg, scale=1e-3)
    calls = {"n": 0}
    base_loss = wl.loss_fn

    def loss_fn(model: nn.Module, b) -> torch.Tensor:
        loss = base_loss(model, b)
        calls["n"] += 1
        return loss * 1e30 if calls["n"] in (4, 5) else loss

    return psarch.Workload(wl.model, loss_fn, wl.batch, wl.entropy_floor, "overflow")


def fails_at_step_2(cfg) -> psarch.Workload:
    """Regression whose loss raises on the third call: a point of a sweep that fails."""
    wl = regression(cfg)
    calls = {"n": 0}

    def loss_fn(model: nn.Module, b) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("deliberate failure at step 2")
        return wl.loss_fn(model, b)

    return psarch.Workload(wl.model, loss_fn, wl.batch, wl.entropy_floor, "fails")


def fails_when_asked(cfg) -> psarch.Workload:
    """Regression whose batch of step PSARCH_TEST_FAIL_AT raises: a run that fails on resume under the very
    config it was written under (a resume may not change the factory)."""
    import os

    wl = regression(cfg)
    fail_at = int(os.environ.get("PSARCH_TEST_FAIL_AT", "-1"))

    def batch(step: int, shard: int, num_shards: int):
        if step == fail_at:
            raise RuntimeError(f"deliberate failure at step {step}")
        return wl.batch(step, shard, num_shards)

    return psarch.Workload(wl.model, wl.loss_fn, batch, wl.entropy_floor, "regression")


def readme_example(cfg) -> psarch.Workload:
    """The "Bring your own model" factory of experiments/README.md, verbatim: its loss_fn does not cast the batch, so it
    runs in bf16/fp16 only because the runner casts floating-point batches to the compute dtype."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def batch(step, shard, num_shards):           # the shard of step `step`'s global batch
        g = step_generator(cfg.seed, step)
        x = torch.randn(cfg.train.global_batch, 8, generator=g)
        return shard_batch(x, shard, num_shards), shard_batch(x.sum(1, keepdim=True), shard, num_shards)

    def loss_fn(model, b):
        x, y = b
        return F.mse_loss(model(x), y)

    return psarch.Workload(model, loss_fn, batch)


def perturbed_by_rank(cfg) -> psarch.Workload:
    """Regression whose initial model differs on every rank (rank r adds r * 0.5 to every parameter):
    only the trainer's start-of-training broadcast from rank 0 makes the ranks agree."""
    import torch.distributed as dist

    wl = regression(cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    with torch.no_grad():
        for p in wl.model.parameters():
            p.add_(0.5 * rank)
    return wl


# The source of a factory module written next to a config (so a spawned rank or torchrun imports it from the
# working directory): rank 1 raises at step 2; each process records its pid in $PSARCH_TEST_PIDDIR.
FAILING_FACTORY = textwrap.dedent('''
    import os
    import torch
    import torch.distributed as dist
    from psarch import Workload

    def make(cfg):
        piddir = os.environ.get("PSARCH_TEST_PIDDIR")
        if piddir:
            open(os.path.join(piddir, str(os.getpid())), "w").close()
        calls = [0]
        model = torch.nn.Linear(4, 1)

        def loss_fn(model, batch):
            step = calls[0]
            calls[0] += 1
            if dist.is_initialized() and dist.get_rank() == 1 and step == 2:
                raise RuntimeError("injected failure at step 2")
            x, y = batch
            return ((model(x) - y) ** 2).mean()

        def batch(step, shard, num_shards):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, 4, generator=g)
            per = 4 // num_shards
            x = x[shard * per:(shard + 1) * per]
            return x, x.sum(1, keepdim=True)

        return Workload(model, loss_fn, batch, name="failing")
''')


def nan_loss_on_last_shard_at_step_3(cfg) -> psarch.Workload:
    """Regression whose last shard (worker N-1) gets NaN inputs at step 3: its loss, and nobody else's, is NaN."""
    wl = regression(cfg)

    def batch(step: int, shard: int, num_shards: int):
        x, y = wl.batch(step, shard, num_shards)
        return (torch.full_like(x, float("nan")), y) if (step, shard) == (3, num_shards - 1) else (x, y)

    return psarch.Workload(wl.model, wl.loss_fn, batch, wl.entropy_floor, "nan-at-step-3")


def aborts_last_shard_at_last_step(cfg) -> psarch.Workload:
    """Regression whose last shard's process kills itself with SIGABRT (as gloo's threads can) when it asks
    for its last batch: a rank that dies of a signal, leaving no error record. No core file is written."""
    import os
    import resource
    import signal

    wl = regression(cfg)

    def batch(step: int, shard: int, num_shards: int):
        if (step, shard) == (cfg.train.steps - 1, num_shards - 1):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), signal.SIGABRT)
        return wl.batch(step, shard, num_shards)

    return psarch.Workload(wl.model, wl.loss_fn, batch, wl.entropy_floor, "aborts")


def aborts_if_finalised(cfg) -> psarch.Workload:
    """Regression whose ranks (spawned, or under torchrun) abort if the interpreter finalises them (an atexit
    hook standing in for gloo's threads, pytorch/pytorch#179291): their run finishes only if they leave
    without finalisation. The launching process, which calls the factory once too, is left alone."""
    import atexit
    import multiprocessing
    import os
    import resource

    from psarch.dist import under_torchrun

    def abort() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.abort()

    if multiprocessing.parent_process() is not None or under_torchrun():
        atexit.register(abort)
    return regression(cfg)


def overflow_on_steps_2_and_3(cfg) -> psarch.Workload:
    """Small-valued regression whose targets at steps 2 and 3 are huge, so fp16 gradients overflow there:
    a function of the step (not of calls), so a run resumed in between overflows at the same steps."""
    wl = regression(cfg, scale=1e-3)

    def batch(step: int, shard: int, num_shards: int):
        x, y = wl.batch(step, shard, num_shards)
        return x, y * 1e30 if step in (2, 3) else y

    return psarch.Workload(wl.model, wl.loss_fn, batch, wl.entropy_floor, "overflow-2-3")


def hangs_at_step(cfg) -> psarch.Workload:
    """Regression that a test can SIGKILL at a known point: where $PSARCH_TEST_HANG_AT names a step, each rank
    writes its pid to $PSARCH_TEST_MARKER + its shard index and sleeps there (between checkpoints); where
    $PSARCH_TEST_HANG_IN_CHECKPOINT names a step, each rank does so inside that checkpoint's write, after its
    data file and before the folder is complete; where $PSARCH_TEST_HANG_SERVER_IN_CHECKPOINT names a step, each PS
    server does so (marker: $PSARCH_TEST_MARKER + "s" + its index) once it has written its part of that checkpoint,
    before it acks the workers' `save`."""
    import os
    import time

    from psarch.checkpoint import writer

    wl = regression(cfg)
    hang = int(os.environ.get("PSARCH_TEST_HANG_AT", "-1"))
    in_checkpoint = int(os.environ.get("PSARCH_TEST_HANG_IN_CHECKPOINT", "-1"))
    server_in_checkpoint = int(os.environ.get("PSARCH_TEST_HANG_SERVER_IN_CHECKPOINT", "-1"))

    def stop_here(shard: int | str) -> None:
        marker = os.environ["PSARCH_TEST_MARKER"] + str(shard)
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)   # a test reading it sees the whole pid
        time.sleep(600)

    def batch(step: int, shard: int, num_shards: int):
        if step == hang:
            stop_here(shard)
        return wl.batch(step, shard, num_shards)

    if in_checkpoint >= 0:
        write_part = writer.write_part

        def slow_write(pieces, folder, part, *args):   # a write still in flight when the kill comes
            write_part(pieces, folder, part, *args)
            if folder.name.endswith(writer.step_dir(folder.parent, in_checkpoint).name):   # under its temporary name
                stop_here(int(part.removeprefix("rank")))
        writer.write_part = slow_write   # where it is looked up: the writer's own save, and the PS worker's
        from psarch.ps.worker import snapshots as worker_snapshots
        worker_snapshots.write_part = slow_write

    if server_in_checkpoint >= 0:   # (servers build the workload too: this runs in their processes)
        from psarch.ps.server import snapshots
        server_write = snapshots.write_part

        def stalled_write(pieces, folder, part, *args):
            server_write(pieces, folder, part, *args)
            if folder.name.endswith(writer.step_dir(folder.parent, server_in_checkpoint).name):
                stop_here("s" + part.removeprefix("server"))
        snapshots.write_part = stalled_write

    return psarch.Workload(wl.model, wl.loss_fn, batch, wl.entropy_floor, "hangs")


def dropout_regression(cfg) -> psarch.Workload:
    """Regression through a model with dropout, whose workers also draw input noise from torch's generator, as
    many draws as their shard index + 1: every rank's generator follows its own stream, which a resumed run
    must continue where each left off."""
    wl = regression(cfg)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))

    def batch(step: int, shard: int, num_shards: int):
        x, y = wl.batch(step, shard, num_shards)
        noise = torch.randn(shard + 1, *x.shape)[-1]   # drawn per worker, like a data augmentation
        return x + 0.01 * noise, y

    return psarch.Workload(model, wl.loss_fn, batch, wl.entropy_floor, "dropout")


class ShuffledBlocks(nn.Module):
    """Blocks registered 0, 1, 2, 3 (each of its own width) and run 2, 0, 1: block 3 never runs, and the order forward
    runs them in is not the order they are registered in. Every parameter's first dimension is even: at N = 2 neither
    ZeRO-3 nor FSDP2 pads, so bytes counted are bytes predicted to the byte."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, h), nn.Tanh(), nn.Linear(h, 8)) for h in (4, 8, 12, 16))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i in (2, 0, 1):
            x = self.blocks[i](x)
        return self.head(x).sum(-1, keepdim=True)


def shuffled_blocks(cfg) -> psarch.Workload:
    """regression's data and loss through ShuffledBlocks."""
    wl = regression(cfg)
    torch.manual_seed(cfg.seed)
    return psarch.Workload(ShuffledBlocks(), wl.loss_fn, wl.batch, wl.entropy_floor, "shuffled")


def loss_only_in_training(cfg) -> psarch.Workload:
    """shuffled_blocks whose loss refuses to run before training has begun (a user's loss that reads state its
    training sets up): what ZeRO-3's reading of the forward order meets as one clear error."""
    w = shuffled_blocks(cfg)

    def loss_fn(model, batch):
        raise RuntimeError("this loss runs only in training\nsecond line")
    return psarch.Workload(w.model, loss_fn, w.batch, w.entropy_floor, "refusing")
