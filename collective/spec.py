"""The collective data-parallel backends, declared (psarch/backend.py): `ddp` (psarch's DDP over a ring or
torch.distributed's collectives) and `torch_ddp` (PyTorch's own DistributedDataParallel, the peer)."""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from collective import compression_theory, theory
from psarch.backend import PROCESS_GROUP_OPTIONS, BackendSpec
from psarch.config.backend import Buckets, Communicator, CoreBackendConfig, Overlap, PSServers, resend_problem
from psarch.config.fields import option
from psarch.errors import ConfigError, show
from psarch.theory import BYTES, Prediction

if TYPE_CHECKING:
    from pathlib import Path

    from psarch.cluster.messages import MessageProbe
    from psarch.cluster.placement import Placement
    from psarch.config import Config
    from psarch.trainer import Services


@dataclass(frozen=True)
class DDPOptions(PSServers, Communicator, Buckets, Overlap, CoreBackendConfig):
    """ddp's [backend]: a communicator, buckets, overlap; the PS servers of its tables with embeddings = "ps"."""


@dataclass(frozen=True)
class TorchDDPOptions(Buckets, CoreBackendConfig):
    """torch_ddp's [backend]: buckets (torch's bucket_cap_mb) and torch's find_unused_parameters."""

    find_unused_parameters: bool = option(
        False, "torch DDP's own flag: walk the autograd graph each step for parameters without a gradient; it also "
        "keeps the first step's bucket layout (no rebuild in the order gradients arrived), so a world restarted from "
        "a checkpoint sums in the same order as the uninterrupted run")


def ddp_step(cfg: Config, phi: float, step: Any, reduced: bool, overlap: bool, chained: bool = False,
             own_buckets: bool = False) -> Any:
    """The dense all-reduce's step program (collective/program.py): buckets of bucket_cap_mb in the order backward
    readies them (the flat buffer holds the parameters in reverse and is cut from its start, so the short bucket is
    the last); own_buckets (ddp): the trainer's own buckets where the config's model holds phi (theory.trainer_buckets:
    a bucket closes at a parameter's edge), else cut at the cap from Φ alone; compressed: collective/compression_theory.py's
    compressed_program; embedding rows all-gathered, row-sharded or on PS servers beside the buckets, compressed or
    not (theory.embedding_calls)."""
    from collective.program import ddp_program
    from psarch.theory.program import chunks

    if cfg.train.compression != "none":   # as predict: compression_theory.compressed, the tables' rows beside
        return compression_theory.compressed_program(cfg, step, overlap, reduced, chained)
    if cfg.backend.embeddings != "dense":
        return theory.embeddings_program(cfg, phi, step, overlap, reduced)
    buckets = (theory.trainer_buckets(cfg, phi) if own_buckets else None) or \
        chunks(phi * BYTES[cfg.train.precision], cfg.backend.bucket_cap_mb * 2**20)
    return ddp_program(cfg.backend.world_size, buckets, step, overlap, reduced)


def check_ps_tables(cfg: Config) -> None:
    """What the hybrid (embeddings = "ps", collective/ps_tables.py) does not run (yet), as one line each; without
    it, the servers' options (PSServers) set at all."""
    b, t = cfg.backend, cfg.train
    if b.embeddings != "ps":
        # timeouts left out: an emulated cluster stretches every backend's (psarch/cluster/dilation.py)
        for f in dataclasses.fields(PSServers):
            if getattr(b, f.name) != f.default and not f.name.endswith("timeout_s"):
                raise ConfigError(f"backend.{f.name} = {show(getattr(b, f.name))}: configures the PS servers of "
                                  f"backend.embeddings = \"ps\"; this run has embeddings = \"{b.embeddings}\"")
        return
    why = (f"train.precision = \"{t.precision}\": the servers' rows move and are updated in fp32 only"
           if t.precision != "fp32" else
           f"train.momentum = {t.momentum:g}: row-wise SGD has no momentum (it would move untouched rows)"
           if t.optimizer == "sgd" and (t.momentum or t.nesterov) else
           f"backend.server_placement = \"colocated\" needs backend.servers <= backend.world_size (here "
           f"{b.servers} > {b.world_size})" if b.server_placement == "colocated" and b.servers > b.world_size else
           f"backend.heartbeat_timeout_s = {b.heartbeat_timeout_s:g}: must be longer than backend.heartbeat_s = "
           f"{b.heartbeat_s:g}" if b.heartbeat_s and b.heartbeat_timeout_s <= b.heartbeat_s else resend_problem(b))
    if why:
        raise ConfigError(f"backend.embeddings = \"ps\" with {why}")
    frozen = [n for n in table_names(cfg) if not any(fnmatch.fnmatchcase(n, pat) for pat in t.trainable)]
    if (t.trainable or t.lora_rank) and frozen:
        raise ConfigError(f"train.trainable = {show(t.trainable)}: leaves the table {frozen[0]!r} frozen, but "
                          f"backend.embeddings = \"ps\" serves the tables to update their rows on the PS; name them "
                          f"in train.trainable (\"tables.*\") or keep frozen tables whole with embeddings = \"dense\"")


def table_names(cfg: Config) -> list[str]:
    """The dlrm model's tables, by parameter name."""
    return [f"tables.{i}.weight" for i in range(cfg.workload.dlrm.num_tables)]


def missing_rows(cfg: Config, start: Path) -> str:
    """Why the hybrid's servers cannot start from the checkpoint at `start` ('' where they can): each table's rows
    must be stored whole (a hybrid's checkpoint: every server's part; a PS rows or dense checkpoint: its tables)."""
    from psarch.checkpoint.fragments import PARAM
    from psarch.checkpoint.reader import Checkpoint

    ckpt = Checkpoint(start)
    try:
        wrote = ckpt.config.get("backend", {})
        if wrote.get("embeddings") == "ps" and wrote.get("kind") != "ps":   # a hybrid's: a part from each server
            lost = [i for i in range(wrote.get("servers", 1)) if f"server{i}.bin" not in ckpt.meta["files"]]
            if lost:
                return (f"the checkpoint {ckpt.path.name} holds no part of server(s) {', '.join(map(str, lost))} "
                        f"(their shards of the tables' rows)")
        for name in table_names(cfg):
            stored = sum(e["numel"] for e in ckpt.meta["fragments"] if e["name"] == name and e["key"] == PARAM)
            whole = ckpt.params[name]["numel"] if name in ckpt.params else 0
            if stored != whole or not whole:
                return f"the checkpoint {ckpt.path.name} holds {stored} of {whole} elements of {name}'s rows"
        return ""
    finally:
        ckpt.close()


class RingHops:
    """A collective backend whose messages are ring hops over gloo (backend.comm "ring") or gloo's own collectives
    ("native"), for dilation's probe (BackendSpec.message_probe; collective/probe.py)."""

    def message_probe(self, cfg: Config, phi: float) -> MessageProbe:
        from collective.probe import hop_s
        from psarch.cluster.messages import MessageProbe
        native = cfg.backend.comm == "native"
        return MessageProbe("gloo's own all-reduce" if native else "a ring hop over gloo", hop_s,
                            ("native" if native else "ring",))


class PSTablesServices:
    """A collective backend's PS servers with embeddings = "ps" (the hybrid, collective/ps_tables.py): its
    services, placed as the PS's (BackendSpec's methods, put before it in a spec's bases)."""

    def service_nodes(self, cfg: Config) -> int:
        return cfg.backend.servers if cfg.backend.embeddings == "ps" else 0

    def service_beside(self, cfg: Config, index: int) -> int | None:
        return index if cfg.backend.server_placement == "colocated" else None

    def shrink_refusal(self, cfg: Config) -> str:
        """Data parallelism restarts at N - 1: a checkpoint reads at any world size (ZeRO's shards resharded), and
        with embeddings = "ps" the servers read their rows back from it, dealt by key mod backend.servers, which
        N does not change."""
        return ""

    def start_services(self, cfg: Config, out_dir: Path, where: Placement | None = None,
                       start: Path | None = None) -> Services | None:
        """With embeddings = "ps": the PS servers of the tables (psarch/ps/services.py)."""
        if cfg.backend.embeddings != "ps":
            return None
        from psarch.checkpoint.finetune import starts_from_base
        from psarch.checkpoint.reader import CheckpointError
        if start is not None and not starts_from_base(cfg, start):
            why = missing_rows(cfg, start)
            if why:
                raise CheckpointError(f"--resume/--from {start}: {why}; backend.embeddings = \"ps\" starts its "
                                      f"servers from every table's rows")
        from psarch.ps.services import LocalServers
        # out_dir: the servers write their parts of the run's checkpoints (rank 0 writes model.pt, its tables
        # fetched from them); they restore the checkpoint the run starts from, or a fine-tune's servers read the
        # base checkpoint it started from (config started_from: psarch/ps/server/start.py)
        return LocalServers(cfg, out_dir, where=where, start=start)


class DDPSpec(RingHops, PSTablesServices, BackendSpec):
    kind = "ddp"
    trains_subsets = True
    checkpoints_compression = True
    fine_tunes_from_base = True
    trainer = "collective.ddp:DDPTrainer"
    doc = "data parallelism: gradients all-reduced by psarch's ring or torch.distributed's collectives"
    options = DDPOptions
    reads = PROCESS_GROUP_OPTIONS
    embeddings = ("dense", "rows", "sharded", "ps")
    subset_embeddings = ("dense", "ps")   # the hybrid: a frozen or LoRA dense part, the tables training on the PS
    base_embeddings = subset_embeddings
    compressions = ("none", "fp16", "bf16", "topk", "powersgd")
    # every treatment keeps the tables out of the compressed buckets: rows all-gathered (excluded), sharded and ps
    # taken out of the model; their rows move whole beside them
    compressed_embeddings = embeddings
    bench_peer = "collective.torch_ddp:plain_ddp_peer"

    def variant(self, cfg: Config) -> str:
        return cfg.backend.comm

    def all_reduce(self, cfg: Config) -> str | None:
        return cfg.backend.comm if cfg.backend.embeddings == "dense" else None

    def check(self, cfg: Config) -> None:
        check_ps_tables(cfg)
        if cfg.backend.embeddings == "sharded" and cfg.train.precision == "fp16":
            raise ConfigError("train.precision = \"fp16\": backend.embeddings = \"sharded\" runs fp32 or bf16 (fp16 "
                              "would need one inf/nan verdict over every rank's shard before a step)")

    def worker_holds_tables(self, cfg: Config) -> bool:
        # sharded: a rank builds only its own rows (collective/sharded.py); ps: the servers build theirs
        return cfg.backend.embeddings not in ("sharded", "ps")

    def predict(self, cfg: Config, phi: float) -> Prediction:
        e = cfg.backend.embeddings
        if cfg.train.compression != "none":
            return compression_theory.compressed(cfg, phi)
        if e == "ps":
            return theory.ps_tables(cfg, phi)
        return theory.rows(cfg, phi) if e == "rows" else theory.sharded(cfg, phi) if e == "sharded" else \
            theory.replicated(cfg, phi)

    def program(self, cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
        return ddp_step(cfg, phi, step, reduced, cfg.backend.overlap_comm, own_buckets=True)


class TorchDDPSpec(BackendSpec):
    kind = "torch_ddp"
    trains_subsets = True
    fine_tunes_from_base = True
    trainer = "collective.torch_ddp:TorchDDPTrainer"
    doc = "PyTorch's DistributedDataParallel (the peer of ddp)"
    options = TorchDDPOptions
    reads = PROCESS_GROUP_OPTIONS
    embeddings = ("dense", "rows")
    compressions = ("none", "fp16", "bf16", "powersgd")   # torch's own DDP communication hooks
    uncompressed_because = "torch ships no top-k DDP communication hook"
    uncompressed_embeddings_because = ("torch's communication hook would get the tables' sparse gradients in its "
                                       "buckets, to compress as it does the dense ones")

    def shrink_refusal(self, cfg: Config) -> str:
        return ""   # torch's DDP replicates the model: its checkpoint reads at any world size

    def all_reduce(self, cfg: Config) -> str | None:
        return "native" if cfg.backend.embeddings == "dense" else None

    def check(self, cfg: Config) -> None:
        t = cfg.train
        if t.compression == "powersgd" and t.powersgd_warmup_steps < 2:
            raise ConfigError(f"train.powersgd_warmup_steps = {t.powersgd_warmup_steps}: torch's powerSGD_hook starts "
                              f"at step 2 at the earliest (DDP rebuilds its buckets after step 1); use 2 or more")
        if cfg.backend.embeddings != "rows":
            return
        # the tables' gradients are torch sparse tensors, which torch's optimizers take only so
        why = ("train.optimizer = \"adamw\": torch's AdamW refuses sparse gradients; use \"sgd\" or \"adagrad\""
               if t.optimizer == "adamw" else
               f"train.weight_decay = {t.weight_decay:g}: torch's {t.optimizer} refuses weight decay on sparse "
               f"gradients; use 0" if t.weight_decay else
               f"train.precision = \"{t.precision}\": sparse gradients step in fp32 only" if t.precision != "fp32"
               else "")
        if why:
            raise ConfigError(f"{why} (backend.kind = \"torch_ddp\" with backend.embeddings = \"rows\" gives the "
                              f"tables sparse gradients; backend.kind = \"ddp\" takes any optimizer)")

    def predict(self, cfg: Config, phi: float) -> Prediction:
        if cfg.train.compression != "none":   # torch's buckets differ from ddp's only by a few elements of padding
            return compression_theory.compressed(cfg, phi)
        return theory.rows(cfg, phi, sparse_grads=True) if cfg.backend.embeddings == "rows" else \
            theory.replicated(cfg, phi)

    def program(self, cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
        # torch DDP always sends from backward's hooks; its powerSGD_hook chains Q's all-reduce to P's
        return ddp_step(cfg, phi, step, reduced, True, chained=True)


DDP = DDPSpec()
TORCH_DDP = TorchDDPSpec()
