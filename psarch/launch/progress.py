"""The progress line rank 0 prints every train.log_every steps, and the same figures as TensorBoard scalars
(train.tensorboard). Its loss is the quantity metrics.jsonl records: the mean over the ranks wherever they
step together, whichever backend runs."""
from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from psarch import registry, throughput
from psarch.config import Config
from psarch.dist import DistContext
from psarch.records import StepRecord
from psarch.trainer import StepStats
from psarch.units import fmt_bytes


def rank_losses(cfg: Config, ctx: DistContext, grouped: bool, metrics: Path | None, echo: bool
                 ) -> Callable[[list[StepRecord]], float]:
    """How the progress line's loss is taken from this rank's records since the last line: the mean over the
    ranks, as metrics.jsonl's loss is (each step's mean over the ranks), wherever the ranks step together.
    Through the process group where there is one (a collective call every rank makes); the PS in sync has
    none, so rank 0 reads its peers' streamed records. Workers at their own pace show rank 0's own."""
    def own(interval: list[StepRecord]) -> float:
        return statistics.fmean(r["loss"] for r in interval)

    if ctx.world_size == 1 or not (grouped or registry.spec_of(cfg).lockstep(cfg)):
        return own
    if grouped or ctx.distributed:
        return lambda interval: ctx.mean_across_ranks(own(interval))
    if metrics is None or not echo or ctx.rank != 0:
        return own   # nobody prints it
    # the peers' streams lie beside this rank's (psarch.launch.outputs.stream_path; outputs imports the runner, so the
    # path is taken from this rank's, not from there)
    peers = PeerStreams([metrics.with_name(f"rank{r}.jsonl") for r in range(1, ctx.world_size)], cfg.backend.timeout_s)

    def over_ranks(interval: list[StepRecord]) -> float:
        if not peers.reached(interval[-1]["step"]):   # a peer lost or stuck: this rank's own, rather than none
            return own(interval)
        return statistics.fmean([own(interval), *peers.interval_means([r["step"] for r in interval])])
    return over_ranks


class PeerStreams:
    """The losses other ranks stream as their steps complete (psarch.launch.outputs.stream_path), read incrementally
    by rank 0 of a run whose workers step together without a process group."""

    def __init__(self, paths: list[Path], timeout_s: float) -> None:
        self.paths, self.timeout_s = paths, timeout_s
        self.read = [0] * len(paths)                       # bytes of complete lines read so far
        self.losses: list[dict[int, float]] = [{} for _ in paths]

    def reached(self, step: int) -> bool:
        """Wait (up to backend.timeout_s) until every peer has streamed `step`; whether they all did."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            for i in range(len(self.paths)):
                self._poll(i)
            if all(step in losses for losses in self.losses):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    def interval_means(self, steps: list[int]) -> list[float]:
        """Each peer's mean loss over `steps`."""
        return [statistics.fmean(losses[s] for s in steps) for losses in self.losses]

    def _poll(self, i: int) -> None:
        try:
            with open(self.paths[i], "rb") as f:
                f.seek(self.read[i])
                text = f.read()
        except OSError:
            return
        complete = text[:text.rfind(b"\n") + 1]   # a line being written is read next time
        self.read[i] += len(complete)
        for line in complete.splitlines():
            row = json.loads(line)
            self.losses[i][row["step"]] = row["loss"]


def board(cfg: Config, ctx: DistContext, metrics: Path | None, fresh: bool) -> Any:
    """With train.tensorboard, rank 0's SummaryWriter into <run>/tensorboard/ (a new run's: an earlier run's
    events there are removed; a resumed run adds its own file), else None."""
    if not cfg.train.tensorboard or ctx.rank != 0 or metrics is None:
        return None
    from torch.utils.tensorboard import SummaryWriter   # the optional extra: psarch[tensorboard]

    folder = metrics.parent.parent / "tensorboard"
    if fresh:
        shutil.rmtree(folder, ignore_errors=True)
    return SummaryWriter(str(folder))


class Progress:
    """The progress line every train.log_every steps, printed by rank 0. Its loss is `losses` of the steps
    since the last line (rank_losses: the mean over the ranks where they step together). Its samples/s
    is the summary's (psarch/throughput.py) over the steps since the last line, and says which: in
    `lockstep`, the global batch over the median step; else rank 0's shard over its median step, the one
    worker whose rate it sees (the summary sums every worker's)."""

    def __init__(self, cfg: Config, ctx: DistContext, floor: float | None, echo: bool, lockstep: bool,
                 losses: Callable[[list[StepRecord]], float], board: Any = None) -> None:
        self.ctx, self.floor, self.echo, self.losses, self.board = ctx, floor, echo, losses, board
        self.every, self.steps = cfg.train.log_every, cfg.train.steps
        self.batch = cfg.train.global_batch if lockstep else cfg.train.global_batch // ctx.world_size
        self.rate_is = throughput.definition(lockstep) if lockstep else throughput.RANK_0

    def after(self, step: int, records: list[StepRecord], stats: StepStats) -> None:
        if (step + 1) % self.every and step + 1 != self.steps:
            return
        interval = records[-((step % self.every) + 1):]
        loss = self.losses(interval)
        median = statistics.median(r["step_time_s"] for r in interval)
        sent = statistics.fmean(r["sent"] for r in interval)
        if self.echo and self.ctx.rank == 0:
            rate = f"{self.batch / median:9.1f} samples/s ({self.rate_is})"
            _print_progress(step, self.steps, len(interval), loss, self.floor, rate, sent,
                            sum(r["skipped"] for r in interval), stats)
        if self.board is not None:   # the line's own figures, at the step it ends on
            for tag, value in (("loss", loss), ("samples_per_s", self.batch / median), ("bytes_sent_per_step", sent)):
                self.board.add_scalar(tag, value, step + 1)


def _print_progress(step: int, steps: int, window: int, loss: float, floor: float | None, samples_per_s: str,
                    bytes_per_step: float, skipped: int, stats: StepStats) -> None:
    """One progress line: the loss is the mean over the `window` steps since the last line (and across
    the ranks of a process group), unlike the summary's final loss, which is the last step's."""
    gap = f"  gap {loss - floor:7.4f}" if floor is not None else ""
    # fp16 steps dropped for inf/nan gradients: the loss above moved without an update
    skip = f"  skipped {skipped}" if skipped else ""
    scale = f"  scale {stats.loss_scale:g}" if stats.loss_scale not in (None, 1.0) else ""
    print(f"step {step + 1:>6}/{steps}  {window}-step mean loss {loss:8.4f}{gap}  {samples_per_s}  "
          f"{fmt_bytes(bytes_per_step)}/step sent{skip}{scale}", flush=True)
