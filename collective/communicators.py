"""The communicators by name (`backend.comm`): a hand-written ring over point-to-point and torch.distributed's own."""
from __future__ import annotations

import torch.distributed as dist

from collective.comm import Communicator, Handle
from collective.native import NativeCommunicator
from collective.ring import RingCommunicator
from collective.ring_plain import PlainRingCommunicator

COMMUNICATORS: dict[str, type[Communicator]] = {"ring": RingCommunicator, "native": NativeCommunicator}


def make_communicator(kind: str, group: dist.ProcessGroup | None = None, **options) -> Communicator:
    """The communicator named by `backend.comm` ("ring" or "native"); options go to its constructor."""
    if kind not in COMMUNICATORS:
        raise ValueError(f"unknown communicator {kind!r}; allowed: {', '.join(sorted(COMMUNICATORS))}")
    return COMMUNICATORS[kind](group, **options)


__all__ = ["Communicator", "Handle", "RingCommunicator", "PlainRingCommunicator", "NativeCommunicator",
           "make_communicator", "COMMUNICATORS"]
