"""A virtual device's clock for the work a backend does beside the model's forward and backward: a gradient
compression's own (PowerSGD's products and orthonormalisations, top-k's passes over its bucket).

The backend names each piece of work where it does it, with what the prediction prices it at (its FLOPs and bytes
moved in device memory, from the theory's formulas: collective/compression_theory.py's compression_work,
psarch/ps/theory.py's compressing_bytes); the clock runs it for real, then waits until its modelled time
(FLOPs / the device's FLOP rate + bytes / its memory bandwidth, psarch.cluster.device.rates, as the prediction's
DataStep.seconds) x D has passed since it began. The wait falls where the work is done (inside a bucket's hook, or
its finish), so it overlaps communication as the device's work would; never the host's measured time. Work the
device's rates price at nothing (a custom device's memory-bound passes) takes what the host takes. The straggler
factor is not applied: the prediction prices the work at the device's nominal rates.

The clock's wall time inside work on the thread that made it (the one that runs forward and backward) moves the
model's paced deadlines as a communication wait does (psarch/cluster/pacing.py): work in a gradient's hook delays
the rest of backward, as on the device; work on another thread (a future's callback on a communication thread)
does not hold up the model's compute.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator


class WorkClock:
    """Paces work at a virtual device's rates, x `dilation`; 0 rates: what is not known is priced at nothing."""

    def __init__(self, flops_per_s: float, memory_bytes_per_s: float, dilation: float) -> None:
        if flops_per_s < 0 or memory_bytes_per_s < 0 or dilation <= 0:
            raise ValueError(f"WorkClock: rates must be >= 0 and dilation > 0, got {flops_per_s}, "
                             f"{memory_bytes_per_s}, {dilation}")
        self.flops_per_s, self.memory_bytes_per_s, self.dilation = flops_per_s, memory_bytes_per_s, dilation
        self.spent_s = 0.0      # wall seconds inside work on this thread since now (moves the phases' deadlines)
        self.thread = threading.get_ident()
        self.lock = threading.Lock()   # work is also done on communication threads (a future's callback)
        self.new_step()

    def new_step(self) -> None:
        """Start a step's accounting."""
        self.modelled_s = 0.0   # this step's work at the device's rates, cluster time
        self.host_s = 0.0       # this machine's time doing it, wall
        self.overran = False    # a piece of priced work took the host longer than its modelled time x D

    def seconds(self, flops: float, nbytes: float) -> float:
        """The device's time for `flops` and `nbytes` moved in its memory, cluster time (DataStep.seconds)."""
        from psarch.theory.program import DataStep

        device = DataStep(0.0, 0.0, flops_per_s=self.flops_per_s, memory_bytes_per_s=self.memory_bytes_per_s)
        return device.seconds(flops, nbytes)

    @contextmanager
    def work(self, flops: float, nbytes: float = 0.0) -> Iterator[None]:
        """Run the block, then wait until its modelled time x D has passed since it began."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            host = time.perf_counter() - t0
            modelled = self.seconds(flops, nbytes)
            if modelled * self.dilation > host:
                time.sleep(modelled * self.dilation - host)
            with self.lock:
                self.modelled_s += modelled
                self.host_s += host
                self.overran |= modelled > 0 and host > modelled * self.dilation
            if threading.get_ident() == self.thread:
                self.spent_s += time.perf_counter() - t0
