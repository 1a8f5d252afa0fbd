"""The ZeRO backends, declared (psarch/backend.py): `zero` (psarch's stages 1-3 over a collective
communicator) and PyTorch's own peers `torch_zero` (DDP + ZeroRedundancyOptimizer) and `torch_fsdp` (FSDP2)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psarch.backend import PROCESS_GROUP_OPTIONS, BackendSpec, compression_label
from collective.spec import PSTablesServices, RingHops, check_ps_tables
from psarch.config.backend import (ActivationMemory, Buckets, Communicator, CoreBackendConfig, ModelUnits, Overlap,
                                   PSServers)
from psarch.config.fields import option
from psarch.theory import BYTES, Prediction, table_params
from zero import theory

if TYPE_CHECKING:
    from psarch.config import Config


CASTS = ("none", "fp16", "bf16")   # what zero and its torch peers compress: the gradients cast to 2 bytes
UNCOMPRESSED_BECAUSE = ("ZeRO reduce-scatters gradients, adding chunks hop by hop: a ring cannot add top-k's sparse "
                        "(index, value) pairs on the way, and PowerSGD factors whole matrices, not a rank's shard")


@dataclass(frozen=True)
class ZeroOptions(PSServers, Communicator, Overlap, ModelUnits, ActivationMemory, CoreBackendConfig):
    """zero's [backend]: its own options, named as DeepSpeed names them, a communicator, overlap, the model's
    units and measured activations."""

    stage: int = option(1, "1 (optimizer state), 2 (+gradients), 3 (+parameters)", choices=(1, 2, 3))
    reduce_bucket_size: int = option(5 * 10**8, "elements per gradient reduce-scatter bucket", min=1)
    allgather_bucket_size: int = option(5 * 10**8, "elements per parameter all-gather bucket", min=1)
    prefetch_bucket_size: int = option(5 * 10**7, "elements gathered ahead of use", min=0)
    activation_checkpointing: bool = option(False, "recompute each unit's activations in backward")


@dataclass(frozen=True)
class TorchZeroOptions(Buckets, CoreBackendConfig):
    """torch_zero's [backend]: the buckets of the DDP it wraps."""


@dataclass(frozen=True)
class TorchFSDPOptions(ModelUnits, CoreBackendConfig):
    """torch_fsdp's [backend]: the units fully_shard wraps."""


class ZeroSpec(RingHops, PSTablesServices, BackendSpec):
    kind = "zero"
    trains_subsets = True
    fine_tunes_from_base = True
    trainer = "zero.trainer:ZeroTrainer"
    doc = "ZeRO stages 1-3: optimizer state, gradients and parameters partitioned over the ranks"
    options = ZeroOptions
    variant_key = "stage"
    bench_peer = "zero.torch_peers:plain_fsdp2_peer"
    bench_options = {"stage": 3}
    compressions = CASTS   # the gradients' reduce-scatter in 2 bytes (zero/wire.py)
    uncompressed_because = UNCOMPRESSED_BECAUSE
    reads = {**PROCESS_GROUP_OPTIONS, "backend.reduce_bucket_size": (1, 2), "backend.allgather_bucket_size": (1, 2),
             "backend.prefetch_bucket_size": (3,)}
    embeddings = ("dense", "ps")   # ps: the tables on PS servers (collective/ps_tables.py)
    compressed_embeddings = embeddings   # the servers' rows move whole beside the cast reduce-scatters
    subset_embeddings = embeddings
    base_embeddings = embeddings

    def check(self, cfg: Config) -> None:
        check_ps_tables(cfg)

    def worker_holds_tables(self, cfg: Config) -> bool:
        return cfg.backend.embeddings != "ps"   # the servers build their rows

    def variant(self, cfg: Config) -> str:
        return f"stage{cfg.backend.stage}/{cfg.backend.comm}"

    def label(self, cfg: Config) -> str:
        text = f"zero-{cfg.backend.stage} {cfg.backend.comm}"
        text = text if cfg.backend.embeddings == "dense" else f"{text}, embeddings {cfg.backend.embeddings}"
        return text + compression_label(cfg)

    def predict(self, cfg: Config, phi: float) -> Prediction:
        stage = cfg.backend.stage
        if cfg.backend.embeddings == "ps":   # ZeRO over the dense layers, the tables on the servers
            from collective.theory import with_ps_tables
            dense = phi - table_params(cfg)
            p = theory.zero(cfg, dense, stage, theory.passes(stage))
            p = with_ps_tables(theory.without_never_run(p, cfg, dense) if stage == 3 else p, cfg, phi)
        else:
            p = theory.zero(cfg, phi, stage, theory.passes(stage))
            p = theory.without_never_run(p, cfg, phi) if stage == 3 else p   # its trainer skips them too
        return theory.zero3_frozen(p, cfg) if stage == 3 else p   # stages 1-2 keep frozen weights whole

    def compute_holds_waits(self, cfg: Config) -> bool:
        return cfg.backend.stage == 3   # its forward's and backward's all-gathers block where nothing times them

    def program(self, cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
        """zero/program.py's step: stages 1-2 in buckets of reduce_bucket_size and allgather_bucket_size elements;
        stage 3 unit by unit as zero/stage3.py gathers, prefetches and reduce-scatters them (zero3_script), over
        the config's model's units in forward's order (_units), those that train scaled to Φ = phi and the frozen ones
        gathered with them, each unit padded to N as zero/frozen.py shards it, backward gathering only the units it
        reaches (theory.backward_reaches); embedding tables on PS servers: each
        rank's rows pulled before forward, pushed after backward. The reduce-scatters move gradient_width's bytes per
        element (2 where train.compression casts), the all-gathers the compute dtype's."""
        from psarch.theory.program import chunks
        from zero.program import sharded, stage12_program, zero3_script

        b, width = cfg.backend, BYTES[cfg.train.precision]
        grad_share = theory.gradient_width(cfg) / width   # 0.5 where train.compression casts fp32 gradients
        tables = None
        if b.embeddings == "ps":   # ZeRO over the dense layers, the tables on the servers
            from collective.theory import table_servers
            phi, tables = phi - table_params(cfg), table_servers(cfg)
        s, n = phi * width, b.world_size
        if b.stage == 3:
            from zero.stage12 import MAX_IN_FLIGHT

            sizes, reached = _units(cfg)
            trains = sum(t for t, _ in theory.unit_sizes(cfg)) or 1   # those left out included
            frozen = [float(width * theory.padded_size(f, n)) for _, f in sizes] if theory.trains_a_subset(cfg) else None
            script = zero3_script([s * t / trains for t, _ in sizes], step, b.prefetch_bucket_size * width,
                                  b.overlap_comm, MAX_IN_FLIGHT, frozen, grad_share, reached)
            return sharded(n, script, reduced, step.optimizer_s, tables)
        return stage12_program(n, chunks(s, b.reduce_bucket_size * width), chunks(s, b.allgather_bucket_size * width),
                               step, b.overlap_comm, reduced, tables=tables, grad_share=grad_share)


class TorchZeroSpec(BackendSpec):
    kind = "torch_zero"
    trains_subsets = True
    fine_tunes_from_base = True
    trainer = "zero.torch_peers:TorchZeroTrainer"
    doc = "PyTorch's DDP + ZeroRedundancyOptimizer (ZeRO-1; the peer of zero stage 1)"
    options = TorchZeroOptions
    reads = PROCESS_GROUP_OPTIONS
    compressions = CASTS   # torch's fp16_compress_hook / bf16_compress_hook on its DDP (collective/torch_ddp.py)
    uncompressed_because = f"the peer of zero: {UNCOMPRESSED_BECAUSE}"
    precisions = ("fp32",)

    def shrink_refusal(self, cfg: Config) -> str:
        return ""   # the optimizer's shards, resharded at any world size by the checkpoint

    def predict(self, cfg: Config, phi: float) -> Prediction:
        return theory.zero(cfg, phi, 1, 3, gradient_passes=2)   # the all-reduce's 2 passes carry the gradients

    def program(self, cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
        """torch DDP's buckets of bucket_cap_mb all-reduced from backward's hooks (in 2 bytes where train.compression
        casts), the optimizer on the rank's shard, then the shards' broadcasts (one all-gather pass over the
        parameters)."""
        from psarch.theory.program import chunks
        from zero.program import stage12_program

        width = BYTES[cfg.train.precision]
        s = phi * width
        return stage12_program(cfg.backend.world_size, chunks(s, cfg.backend.bucket_cap_mb * 2**20), [s], step,
                               True, reduced, reduce_passes=2, grad_share=theory.gradient_width(cfg) / width)


class TorchFSDPSpec(BackendSpec):
    kind = "torch_fsdp"
    trains_subsets = True
    fine_tunes_from_base = True
    trainer = "zero.torch_peers:TorchFSDPTrainer"
    doc = "PyTorch's FSDP2 fully_shard per unit (ZeRO-3; the peer of zero stage 3)"
    options = TorchFSDPOptions
    reads = PROCESS_GROUP_OPTIONS
    compressions = CASTS   # MixedPrecisionPolicy(reduce_dtype=fp16/bf16): the reduce-scatter in 2 bytes
    uncompressed_because = f"the peer of zero: {UNCOMPRESSED_BECAUSE}"
    precisions = ("fp32",)

    def shrink_refusal(self, cfg: Config) -> str:
        return ""   # FSDP2's shards, resharded at any world size by the checkpoint

    def predict(self, cfg: Config, phi: float) -> Prediction:
        return theory.fsdp2(cfg, phi)

    def compute_holds_waits(self, cfg: Config) -> bool:
        return True   # FSDP2's collectives run inside forward, backward and its step, where nothing times them

    def program(self, cfg: Config, phi: float, step: Any, reduced: bool = False) -> Any:
        """zero/program.py's ZeRO-3 step over the model's units in forward's order (_units; the root first, kept
        gathered from forward through backward, as FSDP2 keeps the root's), those that train scaled to Φ = phi and the frozen ones
        gathered with them, each unit's all-gather issued as the unit before it starts (FSDP2's prefetch of one); the
        reduce-scatters in gradient_width's bytes (2 where train.compression casts: FSDP2's reduce_dtype); backward
        reaches only the units theory.backward_reaches names."""
        from zero.program import stage3_program

        width = BYTES[cfg.train.precision]
        sizes, reached = _units(cfg)
        trains = sum(t for t, _ in theory.unit_sizes(cfg)) or 1   # those left out included
        return stage3_program(cfg.backend.world_size, [phi * width * t / trains for t, _ in sizes], step, reduced,
                              prefetch=1, keep_first=True, frozen=[width * f for _, f in sizes],
                              grad_share=theory.gradient_width(cfg) / width, reached=reached)


def _units(cfg: Config) -> tuple[list[tuple[int, int]], list[bool]]:
    """The model's units as (trainable, frozen) sizes and whether backward reaches each (theory.unit_sizes,
    theory.backward_reaches), the root first, then the blocks in the order their forwards run (theory.forward_order:
    zero/stage3.py gathers and prefetches by it, as FSDP2 does); a unit forward never runs is left out (neither
    gathers it: theory.never_run)."""
    sizes, reached = theory.unit_sizes(cfg), theory.backward_reaches(cfg)
    order = [0] + [i for i in theory.forward_order(cfg) if i]
    return [sizes[i] for i in order], [reached[i] for i in order]


ZERO = ZeroSpec()
TORCH_ZERO = TorchZeroSpec()
TORCH_FSDP = TorchFSDPSpec()
