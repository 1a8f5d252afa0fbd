"""Meters: bytes on the wire, bytes held by tensors, peak memory."""
from __future__ import annotations

import resource
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, overload

import torch

from psarch.trainer import MemoryReport, OpTraffic, TrafficReport


class TrafficMeter:
    """Counts bytes sent and received, by operation. Safe to update from a communication thread.

    Inside `with meter.tagged("export"):` every operation is booked as "export_<op>", so traffic that
    belongs to no training step (a checkpoint's gather) is kept apart from the step's own."""

    def __init__(self, modelled: bool = False) -> None:
        self.modelled = modelled
        self._ops: dict[str, OpTraffic] = {}
        self._lock = threading.Lock()
        self._tag: str | None = None

    def add(self, op: str, sent: int, received: int, calls: int = 1) -> None:
        if sent < 0 or received < 0 or calls < 0:
            raise ValueError(f"traffic of {op!r} must be counted up: got sent={sent}, received={received}, "
                             f"calls={calls}; book traffic that is no step's under `tagged(...)` instead")
        with self._lock:
            if self._tag is not None:
                op = f"{self._tag}_{op}"
            o = self._ops.setdefault(op, OpTraffic())
            o.sent += int(sent)
            o.received += int(received)
            o.calls += calls

    @contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        """Book every operation counted while open (from any thread) as "<tag>_<op>". The tag belongs to the
        meter, not to a call: open it only while no collective of another kind is in flight."""
        if not tag or not tag.isidentifier():
            raise ValueError(f"traffic tag must be a name like 'export', got {tag!r}")
        with self._lock:
            if self._tag is not None:
                raise RuntimeError(f"traffic is already tagged {self._tag!r}; tags do not nest (asked for {tag!r})")
            self._tag = tag
        try:
            yield
        finally:
            with self._lock:
                self._tag = None

    def report(self) -> TrafficReport:
        with self._lock:
            ops = {k: OpTraffic(v.sent, v.received, v.calls) for k, v in self._ops.items()}
        return TrafficReport(ops=ops, modelled=self.modelled)

    def reset(self) -> None:
        with self._lock:
            self._ops.clear()


class Transient:
    """Bytes of transient buffers held now and their peak, by kind (ZeRO: 'gathered' parameters, 'grads'
    buffers, 'send' copies) and over all kinds together ('working'): a gathered unit and a gradient bucket
    are different costs, so each is reported on its own as well as in the sum."""

    def __init__(self) -> None:
        self.now: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def add(self, kind: str, nbytes: int) -> None:
        for k in (kind, "working"):
            self.now[k] = self.now.get(k, 0) + nbytes
            self.peak[k] = max(self.peak.get(k, 0), self.now[k])

    def sub(self, kind: str, nbytes: int) -> None:
        for k in (kind, "working"):
            self.now[k] -= nbytes


class WaitClock:
    """Seconds a rank has blocked on communication, summed: `with clock:` around each wait. Read as a
    difference over an interval (a straggler's forward or backward), it is the wait inside that interval."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._t0 = 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.total_s += time.perf_counter() - self._t0


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storage the given tensors occupy (each storage counted once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        if t.is_sparse:  # a sparse gradient (torch_ddp with embeddings = "rows") holds its ids and rows
            total += tensor_bytes([t._indices(), t._values()])
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


@overload
def local(t: torch.Tensor) -> torch.Tensor: ...
@overload
def local(t: torch.Tensor | None) -> torch.Tensor | None: ...
def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """What this rank holds of a tensor: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def local_state_bytes(params: Iterable[torch.Tensor], opt: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes this rank holds of (possibly DTensor) parameters and the
    optimizer stepping them: the torch peers that shard with DTensors (FSDP2, tensor parallelism)."""
    params = list(params)
    state = [local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return (tensor_bytes(local(p) for p in params), tensor_bytes(local(p.grad) for p in params),
            tensor_bytes(state))


def flat_memory(device: torch.device, flat: Any, optimizer: int) -> MemoryReport:
    """Model states of a rank that holds one flat parameter vector and its flat gradient (psarch.flat.FlatParams)
    and `optimizer` bytes of optimizer state; with the process's peak memory."""
    peak, kind = peak_memory(device)
    return MemoryReport(params=tensor_bytes([flat.data]), grads=tensor_bytes([flat.grad]), optimizer=optimizer,
                        peak=peak, peak_kind=kind)


def torch_memory(device: torch.device, params: Iterable[torch.Tensor], opt: torch.optim.Optimizer) -> MemoryReport:
    """Model states of a rank stepping (possibly DTensor) parameters with a torch optimizer: the torch peers."""
    peak, kind = peak_memory(device)
    param_bytes, grad_bytes, optimizer_bytes = local_state_bytes(params, opt)
    return MemoryReport(params=param_bytes, grads=grad_bytes, optimizer=optimizer_bytes, peak=peak, peak_kind=kind)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in an optimizer's state (moments, momentum buffers, step counters)."""
    return tensor_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak memory of this process: CUDA max allocated on a GPU, else peak resident set size.

    On Linux the peak RSS is VmHWM, the high-water mark of this process's own address space:
    getrusage's ru_maxrss survives fork + exec, so a rank spawned by a launcher holding 300 MiB would
    report at least the launcher's 300 MiB, whatever the rank itself used."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "rss"
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "rss"


class SavedActivationMeter:
    """Bytes of activations kept for backward during one forward (`with meter:` around it): the tensors
    autograd saves (through saved-tensor hooks; parameters excluded) plus the inputs that checkpointed units
    keep. Measured from the tensors themselves, each storage counted once; CPU has no allocator statistics
    to ask. With `scope` (modules), only what is saved inside their forwards counts (e.g. transformer blocks)."""

    def __init__(self, exclude_storages: Callable[[], set[int]], scope: Iterable[torch.nn.Module] = ()) -> None:
        self.exclude = exclude_storages  # callable -> data_ptrs of parameter storages now (stage 3 re-gathers)
        self.bytes = 0
        self._seen: set[int] = set()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._scoped = False
        self._inside = 0
        for m in scope:
            self._scoped = True
            m.register_forward_pre_hook(lambda *_: self._enter_scope())
            m.register_forward_hook(lambda *_: self._leave_scope())

    def _enter_scope(self) -> None:
        self._inside += 1

    def _leave_scope(self) -> None:
        self._inside -= 1

    def _count(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key and key not in self._seen and key not in self.exclude():
            self._seen.add(key)
            self.bytes += st.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and (self._inside or not self._scoped):
            self._count(t)
        return t

    def count_inputs(self, args: tuple) -> None:
        """A checkpointed unit keeps its tensor inputs alive until its backward."""
        for a in args:
            if torch.is_tensor(a):
                self._count(a)

    def __enter__(self) -> "SavedActivationMeter":
        self.bytes = 0
        self._seen.clear()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
