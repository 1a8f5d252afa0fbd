"""What a backend declares, once. The core (config, launcher, runner, outputs, compare, theory, cluster) asks
a backend's spec and names no backend: a new backend is its own package plus one registration line
(psarch/registry.py), or `psarch.registry.register(spec)` from code outside psarch.

A spec is a BackendSpec subclass, instantiated once:

    class MySpec(BackendSpec):
        kind = "mine"                                     # backend.kind
        trainer = "mypkg.trainer:MyTrainer"               # a psarch.trainer.Trainer, imported where a rank builds it
        doc = "what it is, in one line"
        options = MyOptions                               # its [backend] class (psarch/config/backend.py)
        reads = {"backend.timeout_s": None}               # the core's per-backend options that it reads
        def predict(self, cfg, phi): ...                  # theory: psarch.theory.Prediction

Everything else has a default below: overriding one is how a backend says it differs.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, TypedDict

if TYPE_CHECKING:   # the core's types: their modules import this one (through the registry), so only the type
    # checker, which never runs them, imports them here
    from psarch.cluster.messages import MessageProbe
    from psarch.cluster.placement import Placement
    from psarch.config import Config
    from psarch.records import Summary
    from psarch.theory import Prediction
    from psarch.theory.program import DataStep, Program
    from psarch.trainer import Services

PRECISIONS = ("fp32", "bf16", "fp16")
# the core's options that backends joined by a process group read (BackendSpec.reads)
PROCESS_GROUP_OPTIONS = {"backend.dist_backend": None, "backend.timeout_s": None}


class EstimateRow(TypedDict):
    """A row a backend adds to `psarch estimate` from Φ alone (BackendSpec.estimate_rows)."""

    label: str
    states: float                # model-state bytes per device
    sent: float                  # bytes per device per step
    bubble: float                # idle fraction


class BackendSpec(ABC):
    """One backend, declared: its name, options, capabilities, services and theory."""

    kind: ClassVar[str]
    trainer: ClassVar[str]                            # "module:Class" of its Trainer
    doc: ClassVar[str] = ""
    # its [backend] class: a frozen dataclass of psarch.config.backend.CoreBackendConfig, the groups of options
    # it includes by name (psarch/config/backend.py) and its own options; None: the core's alone
    options: ClassVar[type | None] = None
    # the core's options marked per_backend that it reads, and its own where only some variants read them:
    # dotted key -> None (every variant) or the values of `variant_key` that read it
    reads: ClassVar[Mapping[str, tuple | None]] = {}
    variant_key: ClassVar[str | None] = None          # the [backend] option that selects its variant
    precisions: ClassVar[tuple[str, ...]] = PRECISIONS
    embeddings: ClassVar[tuple[str, ...]] = ("dense",)
    # train.compression values it applies, and why the others do not (said in the one line that refuses them)
    compressions: ClassVar[tuple[str, ...]] = ("none",)
    uncompressed_because: ClassVar[str] = "its gradients move uncompressed"
    # the embedding treatments (backend.embeddings) its compression runs beside: those whose tables move apart from
    # the compressed gradients (their rows whole), and why the others do not (said in the one line that refuses them)
    compressed_embeddings: ClassVar[tuple[str, ...]] = ("dense",)
    uncompressed_embeddings_because: ClassVar[str] = "its compression beside embedding rows is not written"
    max_world_size: ClassVar[int | None] = None
    needs_process_group: ClassVar[bool] = True        # the launcher joins the ranks in a torch.distributed group
    # it trains a model of which only some parameters train (train.trainable, train.lora_rank): it steps, keeps
    # state for and moves only the parameters that require gradients
    trains_subsets: ClassVar[bool] = False
    subset_embeddings: ClassVar[tuple[str, ...]] = ("dense",)   # the embedding treatments it trains a subset with
    # a LoRA or frozen config started --from the base model's checkpoint takes its weights by name: its ranks' models
    # load them (psarch/checkpoint/finetune.py; tests/test_lora_from.py), and its services, if any, build what they
    # hold from the same checkpoint (the PS's servers: config started_from, psarch/ps/layout.py's initial_flat)
    fine_tunes_from_base: ClassVar[bool] = False
    # the embedding treatments it fine-tunes from a base checkpoint with: where the tables do not live in the ranks'
    # models, its services build them from the checkpoint (the hybrid's PS servers, psarch/ps/server/start.py)
    base_embeddings: ClassVar[tuple[str, ...]] = ("dense",)
    checkpoints: ClassVar[bool] = True                # it writes and reads psarch.checkpoint checkpoints
    # its checkpoints hold its gradient compression's state (top-k's and PowerSGD's error feedback, PowerSGD's Q),
    # so a resumed compressed run goes on as the uninterrupted one
    checkpoints_compression: ClassVar[bool] = False
    # a rank runs the loss function in parts, several calls a step (a pipeline stage): a virtual device paces
    # each call by its own FLOPs (psarch.cluster.call_pacing), not each by the whole step's
    paced_by_call: ClassVar[bool] = False
    # psarch.bench.step: "module:function" of the hand-written PyTorch program beside it, (cfg, device) ->
    # (its name, batch -> loss), and the backend options the benchmark runs it with
    bench_peer: ClassVar[str | None] = None
    bench_options: ClassVar[Mapping[str, Any]] = {}

    # ---------------------------------------------------------------- config

    def check(self, cfg: Config) -> None:
        """Combinations this backend refuses, as one ConfigError each; the declared capabilities (precisions,
        embeddings, world size) are checked before this (psarch.config.rules)."""

    # ---------------------------------------------------------------- names

    def variant(self, cfg: Config) -> str:
        """The algorithm within the backend, e.g. "ring", "stage2/native", "sync" ('' where there is one)."""
        return ""

    def label(self, cfg: Config) -> str:
        """The run's architecture in one label, used by every report, plot and cluster table: the kind, its
        variant, the embedding treatment where it is not dense and the gradient compression where there is one."""
        v = self.variant(cfg)
        text = f"{self.kind} {v}" if v else self.kind
        text = text if cfg.backend.embeddings == "dense" else f"{text}, embeddings {cfg.backend.embeddings}"
        return text + compression_label(cfg)

    def lockstep(self, cfg: Config) -> bool:
        """Whether every worker applies the same update each step (the runs that train the model `single`
        trains, compared in one panel); False for modes where workers run at their own pace."""
        return True

    # ---------------------------------------------------------------- processes

    def batch_shard(self, cfg: Config, rank: int, world_size: int) -> tuple[int, int]:
        """(shard, shards): rank `rank` of `world_size` reads shard `shard` of each step's global batch cut in
        `shards` equal parts. By default every rank its own; ranks that work on the same samples (the stages
        of one pipeline) read the same shard."""
        return rank, world_size

    def processes(self, cfg: Config) -> int:
        """Worker processes the launcher starts: one per worker by default; a backend whose workers are
        threads of one process (dp: one thread per device) says 1."""
        return cfg.backend.world_size

    def frozen_copies(self, cfg: Config) -> int:
        """Copies of the frozen parameters one worker holds (theory's memory): one, its model's; dp's process
        holds one per device."""
        return 1

    def service_nodes(self, cfg: Config) -> int:
        """Processes besides the workers that this run starts (PS servers); on an emulated cluster each is a node
        of its own unless `service_beside` puts it on a worker's."""
        return 0

    def services_hold_the_model(self, cfg: Config) -> bool:
        """Whether its services (service_nodes) hold the dense model, every worker pushing its gradients to them and
        pulling parameters back (a parameter server), rather than a part beside a collective step (tables' rows)."""
        return False

    def service_beside(self, cfg: Config, index: int) -> int | None:
        """The rank of the worker whose node service `index` shares on an emulated cluster (and so its link), or
        None for a node of its own."""
        return None

    def start_services(self, cfg: Config, out_dir: Path, where: Placement | None = None,
                       start: Path | None = None) -> Services | None:
        """Services to start before the workers (rank 0 under torchrun); None when the backend has none.
        `where` places each service (psarch.cluster; None: loopback); `start`: the checkpoint the run starts from."""
        return None

    def tolerates_lost_workers(self, cfg: Config) -> bool:
        """Whether the run goes on when a worker dies (the services are told, via Services.worker_lost)."""
        return False

    def shrink_refusal(self, cfg: Config) -> str:
        """Why faults.restart = "shrink" cannot restart this run at world size N - 1 from its checkpoint; '' where it
        can (every rank holds the model, or an even shard of it that a checkpoint reshards at any N)."""
        return (f"backend.kind = \"{cfg.backend.kind}\" does not say that its checkpoint restarts at another world "
                f"size; use \"replace\"")

    def worker_holds_tables(self, cfg: Config) -> bool:
        """Whether a worker's model materialises the embedding tables (False: they stay on the meta device
        and the backend builds its rows where they live)."""
        return True

    # ---------------------------------------------------------------- theory

    @abstractmethod
    def predict(self, cfg: Config, phi: float) -> Prediction:
        """What theory predicts for a run of `cfg` with `phi` parameters (psarch.theory.Prediction)."""

    def estimate_rows(self, phi: float, world: int, precision: str, optimizer: str,
                      options: Mapping[str, Any]) -> list[EstimateRow]:
        """Rows this backend adds to `psarch estimate`, from Φ alone (no model), for the command line's
        `options` (e.g. a pipeline's stages); [] by default (its figures are in the tables already)."""
        return []

    def compute_holds_waits(self, cfg: Config) -> bool:
        """Whether a measured step's compute (the step less the wait its trainer times apart, StepStats.comm_s)
        holds waits for communication too: collectives that block inside forward and backward and that nothing
        times (ZeRO-3's gathers, torch's peers). The step simulator then takes as compute what, played with the
        program's communication, ends when the measured compute ends (psarch.theory.pure_compute)."""
        return False

    def program(self, cfg: Config, phi: float, step: DataStep, reduced: bool = False) -> Program | None:
        """Its training step as a program for the step simulator (psarch.theory.program, played by
        psarch.theory.simulate), ranks computing `step`; reduced: the form in which one node stands for alike ones
        (for large N). None where it has none written yet."""
        return None

    def all_reduce(self, cfg: Config) -> str | None:
        """How its step all-reduces the whole gradients, each rank keeping the whole model and nothing beside it
        ("ring": psarch's own ring; "native": torch's collective): data parallelism's reference, against which a
        parameter server is set (BytePS's bound is over all-reduce's time); None where its step is another."""
        return None

    def summary_fields(self, cfg: Config) -> Summary:
        """Fields this backend adds to summary.json's top level (e.g. the PS's server count)."""
        return {}

    # ---------------------------------------------------------------- this machine

    def message_probe(self, cfg: Config, phi: float) -> MessageProbe | None:
        """How its messages move, for dilation's probe of this machine's cost per message (psarch.cluster.messages:
        its own code path, e.g. a real server's exchange, a ring hop); None: a TCP ping-pong's on loopback."""
        return None


def compression_label(cfg: Config) -> str:
    """', fp16 grads', ', top-k 0.01', ', PowerSGD r=4' where train.compression says so, else ''."""
    t = cfg.train
    return {"none": "", "fp16": ", fp16 grads", "bf16": ", bf16 grads", "topk": f", top-k {t.topk_ratio:g}",
            "powersgd": f", PowerSGD r={t.powersgd_rank}"}[t.compression]
