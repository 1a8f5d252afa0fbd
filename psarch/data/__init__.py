"""Built-in data: every step's global batch is a deterministic function of (seed, step)."""
from psarch.data.clicks import ClickSource
from psarch.data.markov import MarkovSource
from psarch.data.text import TextSource

__all__ = ["ClickSource", "MarkovSource", "TextSource", "step_generator", "shard_batch"]

from typing import overload

import numpy as np
import torch


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A generator for step `step`: independent of the world size, so every backend sees the same data."""
    key = np.random.SeedSequence([seed, step, stream]).generate_state(2, np.uint32)  # a hash: no collisions
    return torch.Generator().manual_seed(int(key[0]) << 31 | int(key[1]) >> 1)


@overload
def shard_batch(batch: torch.Tensor, shard: int, num_shards: int) -> torch.Tensor: ...
@overload
def shard_batch(batch: tuple[torch.Tensor, ...], shard: int, num_shards: int) -> tuple[torch.Tensor, ...]: ...
def shard_batch(batch: torch.Tensor | tuple, shard: int, num_shards: int) -> torch.Tensor | tuple:
    """Samples [shard*B/n, (shard+1)*B/n) of a global batch of B (of each tensor of a tuple)."""
    if isinstance(batch, tuple):
        return tuple(shard_batch(b, shard, num_shards) for b in batch)
    size = batch.shape[0]
    if size % num_shards:
        raise ValueError(f"global batch of {size} samples does not split into {num_shards} equal shards")
    per = size // num_shards
    return batch[shard * per:(shard + 1) * per]
