"""What a local run's servers leave in its folder beside summary.json (psarch/ps/services.py's finish): model.pt
from their final parameters (so a run whose rank 0 was lost still has its model) and the SSP trace."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from psarch.checkpoint.finetune import restore_base
from psarch.config import Config
from psarch.ps.partitions import replicas
from psarch.ps.replication import join_held
from psarch.records import Summary


def write_outputs(cfg: Config, out_dir: Path, out: Summary, parts: list[torch.Tensor], live: list[int]) -> None:
    """model.pt from the `live` servers' final parameters `parts` (in the order of `live`); the ssp trace beside the
    summary (in `out_dir`)."""
    if "ssp" in out:
        (out_dir / "ssp_trace.json").write_text(json.dumps(out["ssp"].pop("trace")))
        out["ssp"]["trace_file"] = "ssp_trace.json"
    if not all(p.numel() for p in parts) or cfg.backend.embeddings == "ps":
        # no worker ever sent init, or the hybrid's servers (a collective backend's tables, whose rank 0 writes
        # model.pt with them fetched): rank 0's record (if any) is all there is
        return
    from psarch.ps.layout import join_servers, state_from_flat
    from psarch.ps.rows import join_parts, key_space
    from psarch.workload import build_workload
    try:
        model = build_workload(cfg).model
        restore_base(cfg, model)   # a fine-tune's frozen weights: its base checkpoint's, as the workers'
        if cfg.backend.embeddings == "rows":
            state = join_parts(model, cfg, key_space(cfg), parts)
        else:
            flat = _join_replicas(cfg, model, out, parts, live) if replicas(cfg) else join_servers(cfg, parts)
            state = state_from_flat(model, flat)
        torch.save(state, out_dir / "model.pt")
    except Exception as e:  # keep rank 0's model.pt, say why the servers' could not be written
        out["model_from_servers_error"] = f"{type(e).__name__}: {e}"


def _join_replicas(cfg: Config, model: torch.nn.Module, out: Summary, parts: list[torch.Tensor],
                   live: list[int]) -> torch.Tensor:
    """The flat vector from the live servers' held vectors (backend.replicas); whether their copies were identical
    goes into `out`; ValueError where they were not."""
    from psarch.ps.layout import trainable
    flat, same = join_held(cfg, dict(zip(live, parts)), sum(p.numel() for p in trainable(model)))
    out["replication"]["copies_identical"] = same
    if not same:
        raise ValueError("the live servers' copies of some partition differ")
    return flat
