"""A worker's exchanges of the flat parameter vector with the servers: server i owns the contiguous slice
`ranges[i]` of it. Each exchange goes to every server in parallel (client.py); pulled parameters land in the
flat buffer (a GPU worker stages them in host memory: the wire is host memory)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from psarch.flat import FlatParams
from psarch.ps import wire
from psarch.ps.layout import server_ranges
from psarch.ps.worker.client import PSClient, Request


class ServerLink:
    """The dense part of a worker's traffic: pushpull each step (GEO: each sync), pull, fetch, done, save; and
    what the servers said last (the version each sent, the loss scale)."""

    def __init__(self, client: PSClient, flat: FlatParams, servers: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.client, self.flat = client, flat
        self.ranges = server_ranges(flat.numel, servers)
        self.wire_dtype = wire.DTYPE_NAMES[dtype]
        self.host = flat.data if device.type == "cpu" else torch.empty_like(flat.data, device="cpu")
        self.versions = [0] * servers   # the version each server last sent: a push names it
        self.loss_scale = 1.0           # fp16: the servers' loss scale, sent with every pull

    def exchange(self, pushed: torch.Tensor | None, step: int, header: dict[str, Any],
                 before: list[Request] | None = None) -> dict[str, Any]:
        """Push `pushed`'s slices (if given) and pull the parameters for `step` from every server, in
        parallel, one `pushpull` request per server (after `before[i]`, if given); the parameters land
        in the flat buffer. Returns what the replies said."""
        t0 = time.perf_counter()
        reqs = [Request({"op": "pull", "step": step, "want": self.wire_dtype}, into=self.host[lo:hi])
                if pushed is None else
                Request(dict(header, op="pushpull", step=step - 1, version=self.versions[i], offset=lo),
                        pushed[lo:hi], into=self.host[lo:hi])
                for i, (lo, hi) in enumerate(self.ranges)]
        self.client.exchange([[r] if before is None else [before[i], r] for i, r in enumerate(reqs)])
        if self.host is not self.flat.data:
            self.flat.data.copy_(self.host, non_blocking=False)
        replies = [r.reply for r in reqs]
        self.versions = [p["version"] for p in replies]
        self.loss_scale = min(p.get("scale", 1.0) for p in replies)
        out: dict[str, Any] = {"comm_s": time.perf_counter() - t0, "version": self.versions[0],
                               "skipped": any(p.get("skipped", False) for p in replies)}
        for key in ("staleness", "ahead"):
            values = [p[key] for p in replies if key in p]
            if values:
                out[key] = max(values)
        return out

    def pull(self, step: int) -> None:
        """The parameters for `step`, pushing nothing (start-up, a fork from a checkpoint)."""
        self.exchange(None, step, {})

    def fetch(self, after: list[Request] | None = None) -> torch.Tensor:
        """The servers' fp32 parameters (after[i], if given, is sent to server i after its fetch)."""
        final = torch.empty(self.flat.numel, dtype=torch.float32)
        self.client.exchange([[Request({"op": "fetch"}, into=final[lo:hi]), *([after[i]] if after else [])]
                              for i, (lo, hi) in enumerate(self.ranges)])
        return final

    def save(self, step: int, folder: Path) -> None:
        """Ask every server to write its part of checkpoint `step` into `folder` (acked once every worker asked)."""
        self.client.exchange([[Request({"op": "save", "step": step, "path": str(folder)})] for _ in self.ranges])

    def done(self) -> None:
        """Tell every server this worker is done."""
        self.client.exchange([[Request({"op": "done"})] for _ in self.ranges])
