"""What compressed traffic carries, alike on both ends: top-k's selection (`train.compression = "topk"`: a worker's
pushes, worker/topk.py, and a GEO server's pulls, server/deltas.py), and how a pulled delta is added to the copy
a worker holds, by the worker and by the server's mirror of it alike (so the two stay equal bit for bit)."""
from __future__ import annotations

import torch

from psarch.theory import topk_k


def largest(values: torch.Tensor, ratio: float) -> torch.Tensor:
    """The int64 indices of the k largest |values| (k = topk_k(numel, ratio)), in no particular order."""
    return values.abs().topk(topk_k(values.numel(), ratio), sorted=False).indices


def add_delta(held: torch.Tensor, keys: torch.Tensor | None, values: torch.Tensor) -> None:
    """Add a pulled delta to `held` (fp32) in place: values at keys (top-k), or a whole delta (a cast), each
    element one fp32 addition."""
    values = values.reshape(-1).to(held.device, torch.float32)
    if keys is None:
        held.add_(values)
    else:
        held.index_add_(0, keys.to(held.device), values)
