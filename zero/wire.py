"""How a bucket's gradients enter ZeRO's reduce-scatter and how this rank's reduced chunk comes back
(`train.compression`): whole, divided by N in place and reduced straight into the chunk; or cast to 2 bytes
("fp16", "bf16") as collective/compression.py's Cast and torch's fp16_compress_hook do (cast, divide by N,
reduce in 2 bytes, cast back into the fp32 chunk). Only gradients are cast: the parameters' all-gathers stay in
the compute dtype, as ddp's compression leaves its parameters alone. top-k and PowerSGD have no reduce-scatter form
(zero/spec.py says why)."""
from __future__ import annotations

from typing import Callable

import torch

from psarch.meters import Transient
from psarch.precision import DTYPES

Land = Callable[[], None]   # once the reduce-scatter has finished: the reduced chunk in its place


class GradientWire:
    """The (input, output) of each gradient reduce-scatter, and what lands the output in the rank's chunk."""

    def __init__(self, n: int, compression: str, transient: Transient) -> None:
        self.n, self.transient = n, transient
        self.dtype = None if compression == "none" else DTYPES[compression]

    def send(self, grad: torch.Tensor, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Land]:
        """Reduce-scatter `grad` (the bucket's padded gradient) into `chunk` (this rank's part of it, averaged)."""
        if self.dtype is None:
            # average by pre-dividing (keeps fp16 sums in range), as DDP does
            return grad.div_(self.n), chunk, lambda: None
        cast = grad.to(self.dtype).div_(self.n)   # in this order, as torch's fp16_compress_hook
        received = torch.empty(chunk.numel(), dtype=self.dtype, device=chunk.device)
        held = (cast.numel() + received.numel()) * cast.element_size()
        self.transient.add("send", held)   # the 2-byte copies on the wire, as the all-gathers' send copies

        def land() -> None:
            chunk.copy_(received)
            self.transient.sub("send", held)
        return cast, received, land
