"""The communicator interface every collective backend implements, and what its implementations share."""
from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from psarch.meters import TrafficMeter
from psarch.timeline import RECORDER
from psarch.units import fmt_bytes

# Gradients and parameters only ever travel in these dtypes; anything else is a caller's mistake.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class Handle:
    """An in-flight collective: wait() blocks until it has finished and re-raises its error."""

    def __init__(self, wait: Callable[[], object], poll: Callable[[], bool] | None = None) -> None:
        self._wait = wait
        self._poll = poll
        self._done = False

    @classmethod
    def of_future(cls, fut: Future) -> "Handle":
        """A handle on work a communicator thread runs."""
        return cls(fut.result, fut.done)

    def wait(self) -> None:
        """Block until the collective has finished; raise the error it failed with, if any."""
        if not self._done:
            self._wait()
            self._done = True

    def is_completed(self) -> bool:
        """True once the collective has finished (without blocking)."""
        return self._done or (self._poll is not None and self._poll())


class Communicator(ABC):
    """Collectives over the ranks of one torch.distributed group, on flat 1-D buffers, SUM only.

    Every rank must issue the same collectives in the same order. With async_op=True the call returns a
    Handle at once; the tensors belong to the collective until its wait() returns.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, modelled: bool = False) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.traffic = TrafficMeter(modelled=modelled)

    def global_rank(self, group_rank: int) -> int:
        """The default-group rank of a rank of this communicator's group (what point-to-point needs)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        """Sum `tensor` over all ranks, in place."""

    @abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        """Sum `input` over all ranks; rank r receives chunk r of the sum in `output`."""

    @abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        """Concatenate every rank's `input`, in rank order, into `output`."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Handle | None:
        """Copy `tensor` of group rank `src` into `tensor` on every rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has reached the barrier (and this rank's pending work is done)."""

    def close(self) -> None:
        """Release background resources; the communicator cannot be used afterwards."""


def call_started() -> float | None:
    """When a collective starts, in a traced step (psarch.timeline); None otherwise, and nothing is timed."""
    return time.perf_counter() if RECORDER.on else None


def record_call(lane: str, op: str, tensor: torch.Tensor, t0: float | None) -> None:
    """A traced step's collective: `op` over `tensor`'s bytes, from `t0` (call_started) to now, on `lane`."""
    if t0 is not None:
        RECORDER.add(lane, f"{op} {fmt_bytes(tensor.numel() * tensor.element_size())}", t0, time.perf_counter())


# ---- validation: raised in the caller, before any rank communicates, so a bad call cannot desync the ring


def check_flat(t: object, name: str) -> torch.Tensor:
    """Check that `t` is a 1-D contiguous tensor of a supported dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D flat buffer, got shape {tuple(t.shape)}; pass t.view(-1)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride()}; pass t.contiguous()")
    if t.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {allowed}")
    return t


def check_scatter_pair(big: object, small: object, world_size: int, big_name: str, small_name: str) -> None:
    """Check a (world_size * m)-element buffer against its m-element per-rank chunk."""
    check_flat(big, big_name)
    check_flat(small, small_name)
    assert isinstance(big, torch.Tensor) and isinstance(small, torch.Tensor)
    if big.dtype != small.dtype or big.device != small.device:
        raise TypeError(f"{big_name} ({big.dtype}, {big.device}) and {small_name} ({small.dtype}, "
                        f"{small.device}) must have the same dtype and device")
    if big.numel() != world_size * small.numel():
        raise ValueError(f"{big_name} has {big.numel()} elements but must have world_size * "
                         f"{small_name}.numel() = {world_size} * {small.numel()} = {world_size * small.numel()}")


def check_src(src: int, world_size: int) -> None:
    """Check a broadcast source rank."""
    if not isinstance(src, int) or not 0 <= src < world_size:
        raise ValueError(f"broadcast src must be a group rank in [0, {world_size}), got {src!r}")


# ---- ring volumes: what the ring moves, and what the native communicator reports as modelled


def ring_chunk(numel: int, world_size: int) -> int:
    """Elements per ring chunk: ceil(numel / world_size), the buffer padded to world_size equal chunks."""
    return -(-numel // world_size)


def ring_bytes(op: str, numel: int, itemsize: int, world_size: int, rank: int = 0, src: int = 0) -> tuple[int, int]:
    """(sent, received) bytes of one rank in the ring algorithm; numel is the buffer the caller passes."""
    n = world_size
    if n == 1:
        return 0, 0
    if op == "all_reduce":
        c = ring_chunk(numel, n) * itemsize
        return 2 * (n - 1) * c, 2 * (n - 1) * c
    if op == "reduce_scatter":  # numel = input, n chunks
        c = numel // n * itemsize
        return (n - 1) * c, (n - 1) * c
    if op == "all_gather":  # numel = input, one chunk
        return (n - 1) * numel * itemsize, (n - 1) * numel * itemsize
    if op == "broadcast":  # a chain src -> src+1 -> ...: the last rank only receives, src only sends
        pos = (rank - src) % n
        s = numel * itemsize
        return (s if pos < n - 1 else 0), (s if pos > 0 else 0)
    raise ValueError(f"unknown op {op!r}")


# ---- the one place that knows gloo cannot move CUDA tensors point-to-point (nor reduce-scatter them)


def stage_on_host(backend: str, tensors: Sequence[torch.Tensor],
                  written: Sequence[int]) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """On gloo with CUDA tensors, return host copies and a finish() that copies `written` ones back."""
    if backend != "gloo" or not any(t.is_cuda for t in tensors):
        return list(tensors), lambda: None
    host = [t.detach().to("cpu") for t in tensors]

    def finish() -> None:
        for i in written:
            tensors[i].copy_(host[i])

    return host, finish


def grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of `params` after a backward that reached every one of them."""
    grads = [p.grad for p in params]
    missing = [i for i, g in enumerate(grads) if g is None]
    if missing:
        raise RuntimeError(f"parameters {missing[:5]} have no gradient after backward (not used by the loss?)")
    return [g for g in grads if g is not None]


def posted(work: dist.Work | None) -> dist.Work:
    """The work of an isend/irecv; torch returns None only to a rank outside the group, which never posts one."""
    if work is None:
        raise RuntimeError("a point-to-point transfer was posted by a rank outside its group")
    return work


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
             group: dist.ProcessGroup | None, backend: str) -> tuple[dist.Work, dist.Work]:
    """Post a send to global rank `dst` and a receive from global rank `src` of `group`, whose backend the
    communicator read once (`backend`: not looked up again every ring hop); returns (send work, recv work)."""
    if backend == "gloo":  # unbatched cannot deadlock on gloo and costs less; receive posted first
        recv_work = posted(dist.irecv(recv, src, group))
        return posted(dist.isend(send, dst, group)), recv_work
    # Posted as one batch: on NCCL an unbatched send and receive to the same peer (a ring of 2) deadlock.
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, dst, group),
                                    dist.P2POp(dist.irecv, recv, src, group)])
    return works[0], works[1]


class SerialExecutor:
    """One worker thread running submitted collectives in FIFO order, so every rank issues them alike."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False

    def submit(self, fn: Callable[[], None], async_op: bool, tensor: torch.Tensor) -> Handle | None:
        """Queue fn; return its Handle when async_op, else wait for it (and everything queued before)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: communicator is closed")
            if self._error is not None:
                # A failed collective leaves peers mid-ring; starting another would only hang.
                raise RuntimeError(f"{self._name}: an earlier collective failed: {self._error!r}")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            fut: Future = Future()
            # Run the work on the caller's CUDA stream so it follows the kernels that produced the tensor.
            stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
            self._queue.put((fn, fut, stream))
        handle = Handle.of_future(fut)
        if async_op:
            return handle
        handle.wait()
        return None

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut, stream = item
            if not fut.set_running_or_notify_cancel():
                continue
            if self._error is not None:  # work queued behind a failure would find its peers elsewhere
                fut.set_exception(RuntimeError(f"{self._name}: an earlier collective failed: {self._error!r}"))
                continue
            try:
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    fn()
            except BaseException as e:  # handed to whoever waits; the thread keeps draining the queue
                self._error = e
                fut.set_exception(e)
            else:
                fut.set_result(None)

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued work and stop the thread (it is a daemon, so a hung peer cannot block exit)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)
