"""How the flat parameter vector is laid out and split over servers; shared by workers and servers (the layout
itself, each parameter's name, shape and offset, is psarch.flat.flat_layout's, as for every backend)."""
from __future__ import annotations

import threading

import torch

from psarch.config import Config
from psarch.flat import flat_layout
from psarch.precision import compute_dtype
from psarch.trainer import consolidated_state

# the partition arithmetic, here for the modules that read it from the layout
from psarch.ps.partitions import (PARTITION_ALIGN, PARTITION_LINK_S, PARTITION_MAX_BYTES, PIPELINE_DEPTH,  # noqa: F401
                                  chain, held, held_of, held_partitions, one_range, partition_bytes, partition_elems,
                                  partitions, server_partitions,
                                  server_ranges)

Layout = list[tuple[str, torch.Size, int]]   # each parameter's name, shape and offset in a flat vector


def push_dtype(cfg: Config) -> torch.dtype:
    """The dtype a worker's dense pushes travel in: fp16/bf16 where train.compression casts them, else the
    compute dtype (pulls travel in the compute dtype always)."""
    c = cfg.train.compression
    return torch.float16 if c == "fp16" else torch.bfloat16 if c == "bf16" else compute_dtype(cfg.train.precision)


def gather(flat: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    """A server's own vector: its partitions of `flat`, joined (a view when they are one contiguous range)."""
    if one_range(parts):
        return flat[parts[0][0]:parts[-1][1]]
    return torch.cat([flat[a:b] for a, b in parts])


def scatter(own: torch.Tensor, parts: list[tuple[int, int]], flat: torch.Tensor) -> None:
    """Put a server's own vector back at its partitions' places in `flat`."""
    pos = 0
    for a, b in parts:
        flat[a:b].copy_(own[pos:pos + b - a])
        pos += b - a


def join_servers(cfg: Config, owns: list[torch.Tensor]) -> torch.Tensor:
    """The flat vector from every server's own vector (server i's `owns[i]`, its partitions joined)."""
    numel = sum(o.numel() for o in owns)
    flat = torch.empty(numel, dtype=owns[0].dtype)
    for parts, own in zip(server_partitions(cfg, numel), owns):
        if own.numel() != held(parts):
            raise ValueError(f"a server reported {own.numel()} parameters, its partitions hold {held(parts)}")
        scatter(own, parts, flat)
    return flat


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that travel, in the order of the flat vector (registration order)."""
    return [p for p in model.parameters() if p.requires_grad]


def state_from_flat(model: torch.nn.Module, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's consolidated fp32 state_dict, trainable parameters taken from the flat vector."""
    params = trainable(model)
    masters, pos = {}, 0
    for p in params:
        masters[id(p)] = flat[pos:pos + p.numel()].view(p.shape)
        pos += p.numel()
    if pos != flat.numel():
        raise ValueError(f"flat parameter vector of {flat.numel()} elements, the model has {pos}")
    return consolidated_state(model, masters)


SEED_LOCK = threading.Lock()


def initial_flat(cfg: Config) -> torch.Tensor:
    """The run's initial parameters as one fp32 vector, built from the config exactly as every worker
    builds its model (same seed; a fine-tune's base weights from the base checkpoint it starts from; rounded to
    the compute dtype, as the workers' fp32 masters are). Servers start from it, so no worker has to send the
    model."""
    from psarch.checkpoint.finetune import restore_base
    from psarch.workload import build_workload

    with SEED_LOCK:  # build_workload seeds torch's global generator: servers run as threads must take turns
        model = build_workload(cfg).model
    restore_base(cfg, model)   # a frozen config's trainable base parameters start as the base checkpoint's
    model = model.to(compute_dtype(cfg.train.precision))
    return torch.cat([p.detach().reshape(-1).float() for p in trainable(model)])


def meta_model(cfg: Config) -> torch.nn.Module:
    """The config's model on the meta device: names and shapes without memory."""
    from psarch.workload import build_workload

    with SEED_LOCK:  # build_workload seeds torch's global generator: servers run as threads must take turns
        return build_workload(cfg, device="meta").model


def param_layout(cfg: Config) -> Layout:
    """Each trainable parameter's name, shape and offset in the flat vector (what a checkpoint is keyed by)."""
    model = meta_model(cfg)
    return flat_layout(model, trainable(model))
