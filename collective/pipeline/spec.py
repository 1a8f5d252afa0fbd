"""The pipeline-parallel backends, declared (psarch/backend.py): `pipeline` (psarch's stages, schedules as
data, point-to-point activations, dp replicas all-reduced over a ring or torch.distributed) and
`torch_pipeline` (torch.distributed.pipelining's schedules, the peer)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from collective.pipeline.schedule import SCHEDULES
from psarch.backend import PROCESS_GROUP_OPTIONS, BackendSpec, EstimateRow
from psarch.cluster import device
from psarch.config.backend import Communicator, CoreBackendConfig, ModelUnits, units_attr
from psarch.config.fields import option
from psarch.errors import ConfigError
from psarch.theory import Prediction


def _theory() -> ModuleType:
    """This backend's theory, imported when first asked: it needs torch, and a spec (read by config checks
    and `psarch keys`) must not."""
    from collective.pipeline import theory
    return theory


if TYPE_CHECKING:
    from psarch.config import Config


@dataclass(frozen=True)
class PipelineSchedule(CoreBackendConfig):
    """Stages, micro-batches and their schedule: torch_pipeline's [backend], and part of pipeline's."""

    stages: int = option(0, "pipeline stages p (world_size = data-parallel degree x stages; 0: world_size, one "
                            "pipeline)", min=0)
    microbatches: int = option(4, "micro-batches m each pipeline's share of the global batch is cut into", min=1)
    schedule: str = option("1f1b", "order of the micro-batches' forwards and backwards", choices=SCHEDULES)
    virtual_stages: int = option(2, "model chunks v per rank (the interleaved schedule)", min=1)

    @property
    def pipeline_stages(self) -> int:
        """p: `stages`, or the world size where it is 0."""
        return self.stages or self.world_size


@dataclass(frozen=True)
class PipelineOptions(PipelineSchedule, Communicator, ModelUnits):
    """pipeline's [backend]: a schedule, the communicator of its data-parallel all-reduce, the units it cuts
    into stages."""


class PipelineSpec(BackendSpec):
    kind = "pipeline"
    trains_subsets = True
    fine_tunes_from_base = True
    trainer = "collective.pipeline.trainer:PipelineTrainer"
    doc = "pipeline parallelism: the model cut into stages, micro-batches scheduled through them"
    options: ClassVar[type | None] = PipelineOptions
    variant_key = "schedule"
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16")
    paced_by_call = True   # a stage's loss_fn call: its own modules, one micro-batch
    reads = {**PROCESS_GROUP_OPTIONS, "backend.virtual_stages": ("interleaved",)}

    def variant(self, cfg: Config) -> str:
        b = cfg.backend
        v = f" v{b.virtual_stages}" if b.schedule == "interleaved" else ""
        dp = _theory().data_parallel(cfg)
        return f"{b.schedule} p{b.pipeline_stages} m{b.microbatches}{v}" + (f" dp{dp}{self.dp_comm(cfg)}" if dp > 1 else "")

    def dp_comm(self, cfg: Config) -> str:
        """How the variant names its data-parallel all-reduce's communicator."""
        return f"/{cfg.backend.comm}"

    def batch_shard(self, cfg: Config, rank: int, world_size: int) -> tuple[int, int]:
        # rank = dp_rank x stages + stage: the stages of one pipeline read its one shard
        _check_stages(cfg)
        p = cfg.backend.pipeline_stages
        return rank // p, world_size // p

    def check(self, cfg: Config) -> None:
        check_pipeline(cfg, self.kind)

    def shrink_refusal(self, cfg: Config) -> str:
        return (f"backend.kind = \"{self.kind}\" cuts the model into backend.pipeline_stages stages, each replica's "
                f"over its own ranks: N - 1 ranks hold no whole pipeline; use \"replace\"")

    def predict(self, cfg: Config, phi: float) -> Prediction:
        return _theory().predict(cfg, phi)

    def program(self, cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
        return _theory().program(cfg, phi, step, reduced)

    def estimate_rows(self, phi: float, world: int, precision: str, optimizer: str,
                      options: Mapping[str, Any]) -> list[EstimateRow]:
        if not options.get("stages"):
            return []
        return _theory().size_estimate(phi, world, options["stages"], options.get("microbatches", 8), precision,
                                    optimizer)


class TorchPipelineSpec(PipelineSpec):
    kind = "torch_pipeline"
    trainer = "collective.pipeline.torch_peer:TorchPipelineTrainer"
    doc = "torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B (the peer of pipeline)"
    options = PipelineSchedule
    precisions = ("fp32",)

    estimate_rows = BackendSpec.estimate_rows   # the same rows as pipeline's: printed once

    def compute_holds_waits(self, cfg: Config) -> bool:
        return True   # torch's schedule times none of its receives and sends apart: its bubble is in the compute

    def dp_comm(self, cfg: Config) -> str:
        return ""   # its dp all-reduce is torch's

    def check(self, cfg: Config) -> None:
        w, b = cfg.workload, cfg.backend
        this = "backend.kind = \"torch_pipeline\" cuts psarch's built-in GPT into PipelineStage modules"
        if w.factory:
            raise ConfigError(f"workload.factory = {json.dumps(w.factory)}: {this}; a factory's model is not one "
                              f"it knows how to cut (use pipeline, ddp or zero)")
        if w.model != "gpt":
            raise ConfigError(f"workload.model = \"{w.model}\": {this} only (use pipeline, ddp or zero)")
        if device.modelled(cfg):
            raise ConfigError(f"cluster.device = {json.dumps(device.name(cfg))}: {this} and computes its loss "
                              f"itself, which a virtual device cannot pace; use backend.kind = \"pipeline\" or "
                              f"cluster.device = \"{device.MEASURED}\"")
        if b.schedule == "naive":
            raise ConfigError("backend.schedule = \"naive\": torch.distributed.pipelining has no naive schedule "
                              "(its nearest is \"gpipe\" with backend.microbatches = 1)")
        check_pipeline(cfg, self.kind)


def check_pipeline(cfg: Config, kind: str) -> None:
    """The rules every pipeline backend shares: world size, batch and micro-batches, blocks enough."""
    b, t = cfg.backend, cfg.train
    _check_stages(cfg)
    if cfg.cluster.slow_workers or cfg.cluster.jitter:
        key = "cluster.slow_workers" if cfg.cluster.slow_workers else "cluster.jitter"
        raise ConfigError(f"{key}: stragglers slow a worker's whole loss_fn, which a pipeline stage does not run "
                          f"whole (backend.kind = \"{kind}\"); remove it")
    p = b.pipeline_stages
    dp = b.world_size // p
    if t.global_batch % (dp * b.microbatches):
        raise ConfigError(f"backend.microbatches = {b.microbatches}: train.global_batch = {t.global_batch} must split "
                          f"into {dp} pipeline(s) x {b.microbatches} micro-batches of equal size")
    v = b.virtual_stages if b.schedule == "interleaved" else 1
    if b.schedule == "interleaved" and b.microbatches % p:
        raise ConfigError(f"backend.microbatches = {b.microbatches}: the interleaved schedule takes micro-batches in "
                          f"groups of backend.stages = {p}; use a multiple of {p}")
    w = cfg.workload
    if not w.factory and w.model in ("gpt", "mlp") and units_attr(cfg.backend) == "blocks":
        blocks = w.gpt.n_layer if w.model == "gpt" else w.mlp.n_layer
        if blocks < p * v and p * v > 1:
            raise ConfigError(f"backend.stages = {p}: the model has {blocks} blocks (workload.{w.model}.n_layer) "
                              f"and every one of the {p * v} stages (x virtual_stages) needs one "
                              f"(backend.kind = \"{kind}\")")
    if t.trainable or t.lora_rank:
        _check_stages_train(cfg, kind)


def _check_stages_train(cfg: Config, kind: str) -> None:
    """Every stage holds a parameter that trains: a stage with none would step nothing and its backward would
    have nothing to differentiate (the cut, made on the meta device, tells)."""
    try:
        counts = _theory().layout(cfg).stage_params
    except ValueError:
        return   # a model the cut refuses: the rank says why, as it does without trainable patterns
    idle = [j for j, c in enumerate(counts) if c == 0]
    if idle:
        t = cfg.train
        key = (f"train.trainable = {json.dumps(t.trainable)}" if t.trainable
               else f"train.lora_targets = {json.dumps(t.lora_targets)}")
        raise ConfigError(f"{key}: pipeline stage {idle[0]} of {len(counts)} holds no parameter that trains, so it "
                          f"would step nothing (backend.kind = \"{kind}\"); name one of its parameters or use fewer "
                          f"stages")


def _check_stages(cfg: Config) -> None:
    b = cfg.backend
    if b.world_size % b.pipeline_stages:
        raise ConfigError(f"backend.stages = {b.stages}: must divide backend.world_size = {b.world_size} "
                          f"(world_size = data-parallel degree x stages)")


PIPELINE = PipelineSpec()
TORCH_PIPELINE = TorchPipelineSpec()
