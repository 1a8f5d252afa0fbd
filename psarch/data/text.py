"""Byte-level text: sequences of a file's bytes starting at random offsets (vocabulary 256)."""
from __future__ import annotations

from pathlib import Path

import torch


class TextSource:
    """The bytes of one file."""

    vocab_size = 256
    entropy_rate = None  # unknown for real text

    def __init__(self, path: str) -> None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"workload.text.path = {path!r}: no such file")
        self.data = torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)

    def sample(self, rows: int, length: int, gen: torch.Generator) -> torch.Tensor:
        if self.data.numel() < length:
            raise ValueError(f"text file has {self.data.numel()} bytes; sequences need {length}")
        starts = torch.randint(0, self.data.numel() - length + 1, (rows,), generator=gen)  # the last byte too
        idx = starts[:, None] + torch.arange(length)
        return self.data[idx].long()
