"""How ddp averages a bucket of gradients over the ranks (`train.compression`): whole, cast to 2 bytes, top-k
with error feedback, or PowerSGD (Vogels et al., NeurIPS '19) with error feedback and warm start.

Each follows torch's DDP communication hook of the same name where torch has one, step for step, so that
psarch's ddp and torch_ddp with the hook train the same model (tests/test_compression.py):
- fp16/bf16 (torch's fp16_compress_hook): cast, divide by N, all-reduce in 2 bytes, cast back;
- PowerSGD (torch's powerSGD_hook): add the error of the last step, view each tensor as n x m (n its first
  dimension) and factor those where that saves 2x (collective/compression_theory.py's powersgd_plan), all-reduce the rest
  whole and P = M Q, orthonormalise P, all-reduce Q = M^T P, M ~ P Q^T / N; the error is what this rank had
  minus what all agreed on. Q is drawn once (seeded alike on every rank), then reused: the warm start;
- top-k (no torch hook; DGC, Lin et al., ICLR '18): add the error, send the k largest |g| of the bucket as
  (int32 index, value) pairs by all-gather (a ring cannot add sparse chunks on the way), every rank sums all
  ranks' pairs; the error is what was not sent.
On a virtual device (Compression.clock, psarch/cluster/work_pacing.py), each piece of a compression's own work is
paced where it is done, at what collective/compression_theory.py prices it: PowerSGD's products and orthonormalisations
by their FLOPs (powersgd_work), top-k's passes by their bytes (compression_work).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from collective.comm import Communicator, Handle
from collective.compression_theory import INDEX_BYTES, MIN_COMPRESSION_RATE, compression_work, powersgd_work
from psarch.theory import topk_k

if TYPE_CHECKING:
    from psarch.cluster.work_pacing import WorkClock

Finish = Callable[[], None]   # waits for a bucket's collectives and leaves its average in the gradient


def _waited(handle: Handle | None, then: Callable[[], object] = lambda: None) -> Finish:
    def finish() -> None:
        if handle is not None:
            handle.wait()
        then()
    return finish


class Compression(ABC):
    """Averages each bucket's gradient over the ranks of `comm`, launched as the bucket fills."""

    def __init__(self, comm: Communicator) -> None:
        self.comm, self.n = comm, comm.world_size
        self.clock: WorkClock | None = None   # a virtual device's (the runner's, by DDPTrainer.pace_work)

    def work(self, flops: float, nbytes: float = 0.0) -> AbstractContextManager[None]:
        """A block of the compression's own work: paced on the virtual device's clock, if there is one."""
        return nullcontext() if self.clock is None else self.clock.work(flops, nbytes)

    @abstractmethod
    def launch(self, index: int, grad: torch.Tensor, shapes: Sequence[torch.Size]) -> Finish:
        """Start averaging bucket `index` (its flat gradient, made of tensors of `shapes`); finish() completes it."""

    def end_step(self) -> None:
        """Called once every bucket of a step has finished."""

    def state_bytes(self) -> int:
        """Bytes kept from step to step (error feedback, PowerSGD's P and Q)."""
        return 0

    # what a checkpoint keeps of that state (collective/ddp.py writes it), so a resumed run goes on as this one
    def errors(self) -> dict[int, torch.Tensor]:
        """Each bucket's error feedback: one value per element of its gradient, this rank's own."""
        return {}

    def factors(self) -> dict[int, torch.Tensor]:
        """Each bucket's state that every rank holds alike (PowerSGD's Q, its warm start)."""
        return {}

    def restore(self, step: int, errors: dict[int, torch.Tensor], factors: dict[int, torch.Tensor]) -> None:
        """Continue after `step` steps with the state a checkpoint kept (a bucket it did not keep starts fresh)."""


class Uncompressed(Compression):
    """Divide by N and all-reduce (pre-dividing, as torch DDP does, keeps fp16 sums in range)."""

    def launch(self, index: int, grad: torch.Tensor, shapes: Sequence[torch.Size]) -> Finish:
        grad.div_(self.n)
        return _waited(self.comm.all_reduce(grad, async_op=True))


class Cast(Compression):
    """torch's fp16_compress_hook (and bf16_compress_hook): the all-reduce moves 2 bytes per element."""

    def __init__(self, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__(comm)
        self.dtype = dtype

    def launch(self, index: int, grad: torch.Tensor, shapes: Sequence[torch.Size]) -> Finish:
        half = grad.to(self.dtype).div_(self.n)
        return _waited(self.comm.all_reduce(half, async_op=True), lambda: grad.copy_(half))


class TopK(Compression):
    """The k = ceil(ratio x numel) largest entries of each bucket, with error feedback, by all-gather."""

    def __init__(self, comm: Communicator, ratio: float) -> None:
        super().__init__(comm)
        self.ratio = ratio
        self.error: dict[int, torch.Tensor] = {}

    def launch(self, index: int, grad: torch.Tensor, shapes: Sequence[torch.Size]) -> Finish:
        if index in self.error:
            grad.add_(self.error[index])
        else:
            self.error[index] = torch.zeros_like(grad)
        k = topk_k(grad.numel(), self.ratio)
        ready, after = compression_work("topk", shapes, grad.element_size(), self.ratio)
        with self.work(*ready):
            idx = grad.abs().topk(k, sorted=False).indices
            values = grad[idx].div_(self.n)
            error = self.error[index]
            error.copy_(grad)
            error[idx] = 0
        # an int32 index travels as the bits of 1 (fp32) or 2 (bf16) elements of the gradient's dtype
        width = INDEX_BYTES // grad.element_size()
        payload = torch.cat([idx.to(torch.int32).view(grad.dtype), values])
        gathered = grad.new_empty(self.n * payload.numel())
        handle = self.comm.all_gather(gathered, payload, async_op=True)

        def add_up() -> None:
            with self.work(*after):
                grad.zero_()
                for pairs in gathered.view(self.n, -1):   # in rank order: the same sums on every rank
                    ids = pairs[:k * width].clone().view(torch.int32)   # cloned: bf16 offsets may not align to int32
                    grad.index_add_(0, ids.long(), pairs[k * width:])
        return _waited(handle, add_up)

    def state_bytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self.error.values())

    def errors(self) -> dict[int, torch.Tensor]:
        return self.error

    def restore(self, step: int, errors: dict[int, torch.Tensor], factors: dict[int, torch.Tensor]) -> None:
        self.error = dict(errors)


def orthogonalize(matrices: torch.Tensor) -> None:
    """Orthonormalise the columns of each (rows x r) matrix of a batch in place, as torch's powerSGD_hook does:
    Gram-Schmidt where r <= 2 or in half precision (QR takes neither), else QR."""
    batch, _, r = matrices.shape
    if r <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(r):
            col = matrices[:, :, i:i + 1]
            col /= torch.norm(col, dim=1, keepdim=True)
            if i + 1 < r:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        torch.linalg.qr(matrices, out=(matrices, matrices.new_empty(batch, r, r)))


class PowerSGD(Compression):
    """Rank-r PowerSGD per bucket after `warmup` whole steps, with error feedback and warm start; Q's first draw
    from numpy's RandomState(seed), one seed per bucket, as torch's PowerSGDState(random_seed=seed) draws them."""

    def __init__(self, comm: Communicator, rank: int, warmup: int, seed: int) -> None:
        super().__init__(comm)
        self.rank, self.warmup = rank, warmup
        self.rng = np.random.RandomState(seed)
        self.step = 0
        self.error: dict[int, torch.Tensor] = {}
        self.p_memory: dict[int, torch.Tensor] = {}
        self.q_memory: dict[int, torch.Tensor] = {}

    def launch(self, index: int, grad: torch.Tensor, shapes: Sequence[torch.Size]) -> Finish:
        if self.step < self.warmup:
            grad.div_(self.n)
            return _waited(self.comm.all_reduce(grad, async_op=True))
        if index in self.error:
            grad.add_(self.error[index])
        else:
            self.error[index] = torch.zeros_like(grad)
        before = grad.clone()
        whole, by_shape = self._split(grad, shapes)
        matrices = [m for ms in by_shape.values() for m in ms]   # grouped by shape, as torch's hook orders them
        q_numel = sum(m.shape[1] * self._r(m) for m in matrices)
        # a restored Q (a resumed run) is warm already; one of another bucket layout (a fork) is drawn afresh
        fresh = index not in self.q_memory or self.q_memory[index].numel() != q_numel
        if fresh:
            self.q_memory[index] = grad.new_empty(q_numel)
        if index not in self.p_memory:   # P is computed afresh each step: a buffer, never checkpointed
            self.p_memory[index] = grad.new_empty(sum(m.shape[0] * self._r(m) for m in matrices))
        ps, qs = self._factors(index, matrices)
        ready, before_q, after_q = powersgd_work([(m.shape[0], m.shape[1], self._r(m)) for m in matrices])
        with self.work(ready):
            if fresh:
                with torch.random.fork_rng(devices=[]):   # the same draw on every rank, the global RNG untouched
                    torch.manual_seed(self.rng.randint(1_000_000_000))
                    for q in qs:
                        q.copy_(torch.randn(*q.shape, device="cpu", dtype=grad.dtype))
                        orthogonalize(q)
            else:
                for q in qs:
                    orthogonalize(q)
            for m, q, p in zip(matrices, qs, ps):
                torch.bmm(m.unsqueeze(0), q, out=p)
        flat_whole = torch.cat([t.reshape(-1) for t in whole]) if whole else grad.new_empty(0)
        h_whole = self.comm.all_reduce(flat_whole, async_op=True) if whole else None
        h_p = self.comm.all_reduce(self.p_memory[index], async_op=True)

        def decompress() -> None:
            if h_whole is not None:
                h_whole.wait()
            flat_whole.div_(self.n)
            at = 0
            for t in whole:
                t.copy_(flat_whole[at:at + t.numel()].view_as(t))
                at += t.numel()
            assert h_p is not None
            h_p.wait()
            with self.work(before_q):
                for p in ps:   # P is not divided by N: orthonormalising it undoes any scale
                    orthogonalize(p)
                for m, p, q in zip(matrices, ps, qs):
                    torch.bmm(m.unsqueeze(0).transpose(1, 2), p, out=q)
            self.comm.all_reduce(self.q_memory[index])
            self.q_memory[index].div_(self.n)
            with self.work(after_q):
                for p, q, m in zip(ps, qs, matrices):
                    torch.bmm(p, q.transpose(1, 2), out=m.unsqueeze(0))
            torch.sub(before, grad, out=self.error[index])
        return decompress

    def _r(self, matrix: torch.Tensor) -> int:
        return min(matrix.shape[0], matrix.shape[1], self.rank)

    def _split(self, grad: torch.Tensor, shapes: Sequence[torch.Size]) -> tuple[list[torch.Tensor],
                                                                               dict[torch.Size, list[torch.Tensor]]]:
        """The bucket's tensors sent whole, and its n x m matrices to factor grouped by shape (views of grad)."""
        whole: list[torch.Tensor] = []
        by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
        at = 0
        for shape in shapes:
            t = grad[at:at + shape.numel()].view(shape)
            at += shape.numel()
            m = t.view(t.shape[0], -1) if t.dim() else t.view(1, 1)
            if MIN_COMPRESSION_RATE * (m.shape[0] + m.shape[1]) * self._r(m) < m.numel():
                by_shape[m.shape].append(m)
            else:
                whole.append(t)
        return whole, by_shape

    def _factors(self, index: int, matrices: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of P (1 x n x r) and Q (1 x m x r) of each matrix, back to back in the bucket's P and Q buffers."""
        ps, qs, at_p, at_q = [], [], 0, 0
        for m in matrices:
            n, k, r = m.shape[0], m.shape[1], self._r(m)
            ps.append(self.p_memory[index][at_p:at_p + n * r].view(1, n, r))
            qs.append(self.q_memory[index][at_q:at_q + k * r].view(1, k, r))
            at_p, at_q = at_p + n * r, at_q + k * r
        return ps, qs

    def end_step(self) -> None:
        self.step += 1

    def errors(self) -> dict[int, torch.Tensor]:
        return self.error

    def factors(self) -> dict[int, torch.Tensor]:
        return self.q_memory

    def restore(self, step: int, errors: dict[int, torch.Tensor], factors: dict[int, torch.Tensor]) -> None:
        # Q's first draws come from rng in bucket order, all at the first compressed step: a run resumed after
        # it restores every Q (no draw left), one resumed before it draws them from the same seed
        self.step, self.error, self.q_memory = step, dict(errors), dict(factors)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.error, self.p_memory, self.q_memory)
                   for t in d.values())


def make_compression(compression: str, comm: Communicator, ratio: float = 0.01, rank: int = 1, warmup: int = 0,
                     seed: int = 0) -> Compression:
    """The Compression `train.compression` names."""
    if compression == "none":
        return Uncompressed(comm)
    if compression in ("fp16", "bf16"):
        return Cast(comm, torch.float16 if compression == "fp16" else torch.bfloat16)
    if compression == "topk":
        return TopK(comm, ratio)
    if compression == "powersgd":
        return PowerSGD(comm, rank, warmup, seed)
    raise ValueError(f"unknown compression {compression!r}; allowed: none, fp16, bf16, topk, powersgd")
