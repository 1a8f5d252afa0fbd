"""Point-to-point transfers between pipeline stages (torch.distributed isend/irecv), every byte counted.

Each transfer of a step has its own tag (what it carries, micro-batch, chunk), so a receive matches its
send whatever order the two ranks post them in: with interleaving, one pair of ranks carries activations
and gradients the same way. On gloo, CUDA tensors travel through host copies (gloo's point-to-point is
CPU only)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from collective.comm import posted
from psarch.meters import TrafficMeter

KINDS = ("activation", "gradient", "loss")


def tag(kind: str, mb: int, chunk: int, microbatches: int) -> int:
    """The tag of one transfer of a step: unique per (kind, micro-batch, chunk)."""
    return (chunk * microbatches + mb) * len(KINDS) + KINDS.index(kind)


class Transfer:
    """An in-flight send or receive; wait() returns the received tensor (on the caller's device)."""

    def __init__(self, work: dist.Work, tensor: torch.Tensor, finish: Callable[[], torch.Tensor]) -> None:
        self.work, self.tensor, self._finish = work, tensor, finish

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self._finish()


class P2P:
    """One rank's sends and receives to other ranks of `group` (global ranks), booked in `meter` as
    "p2p_<kind>": the bytes of each tensor sent or received."""

    def __init__(self, group: dist.ProcessGroup | None, meter: TrafficMeter) -> None:
        self.group, self.meter = group, meter
        self.host = str(dist.get_backend(group)) == "gloo"

    def send(self, tensor: torch.Tensor, dst: int, kind: str, tag: int) -> Transfer:
        """Start sending `tensor` (kept alive until the transfer is waited on)."""
        t = tensor.detach().contiguous()
        if self.host and t.is_cuda:
            t = t.cpu()
        self.meter.add(f"p2p_{kind}", t.numel() * t.element_size(), 0)
        return Transfer(posted(dist.isend(t, dst, self.group, tag)), t, lambda: t)

    def recv(self, shape: torch.Size | tuple, dtype: torch.dtype, device: torch.device, src: int, kind: str,
             tag: int) -> Transfer:
        """Start receiving a tensor of `shape` and `dtype` from global rank `src`."""
        on = torch.device("cpu") if self.host else device
        buf = torch.empty(shape, dtype=dtype, device=on)
        self.meter.add(f"p2p_{kind}", 0, buf.numel() * buf.element_size())
        return Transfer(posted(dist.irecv(buf, src, self.group, tag)), buf, lambda: buf.to(device))
