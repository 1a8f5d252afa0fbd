"""Parameters and gradients as views into contiguous flat buffers, so collectives move one tensor."""
from __future__ import annotations

from typing import Sequence

import torch


class FlatParams:
    """Re-homes `params` (same dtype and device) into one flat data buffer and one flat grad buffer.

    Parameters keep working as ordinary module parameters; `param.data` and `param.grad` are views, so
    autograd accumulates straight into `grad` and an optimizer step on `data` updates the model."""

    def __init__(self, params: Sequence[torch.nn.Parameter], pad_to: int = 1) -> None:
        if not params:
            raise ValueError("FlatParams: no parameters to flatten")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"FlatParams: parameters must share one dtype and device, got {dtypes} on {devices}")
        self.params = list(params)
        self.offsets: list[int] = []
        n = 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n                                    # real elements
        self.padded_numel = -(-n // pad_to) * pad_to      # + padding so the buffer splits evenly
        dtype, device = dtypes.pop(), devices.pop()
        self.data = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        self.grad = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, view in zip(self.params, self.views(self.data)):
                view.copy_(p.data)
                p.data = view
            for p, view in zip(self.params, self.views(self.grad)):
                p.grad = view

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (shaped like the parameters) into any buffer laid out like this one."""
        return [flat[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]

    def zero_grad(self) -> None:
        self.grad.zero_()

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


def flat_layout(model: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> list[tuple[str, torch.Size, int]]:
    """Each of `params`' name, shape and offset in the flat vector they form, in that order: how a flat
    buffer maps onto the model's parameters (what a checkpoint is keyed by)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out, pos = [], 0
    for p in params:
        out.append((names[id(p)], p.shape, pos))
        pos += p.numel()
    return out
