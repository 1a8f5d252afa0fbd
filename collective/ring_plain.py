"""The textbook ring, one whole chunk per step: slow, obviously correct, the reference for ring.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

from collective.comm import (Communicator, Handle, SerialExecutor, check_flat, check_scatter_pair, check_src,
                             call_started, exchange, posted, record_call, ring_chunk, stage_on_host)


class PlainRingCommunicator(Communicator):
    """Ring reduce-scatter / all-gather over point-to-point sends, each step blocking until done."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(group, modelled=False)
        n = self.world_size
        self._next = self.global_rank((self.rank + 1) % n)
        self._prev = self.global_rank((self.rank - 1) % n)
        self._exec = SerialExecutor(f"plain-ring-rank{self.rank}")
        self._sent = self._received = 0

    # ---- public collectives: validate here, run on the communicator thread

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        check_flat(tensor, "tensor")
        return self._exec.submit(lambda: self._run("all_reduce", self._all_reduce, [tensor], [0]), async_op, tensor)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        check_scatter_pair(input, output, self.world_size, "input", "output")
        return self._exec.submit(lambda: self._run("reduce_scatter", self._reduce_scatter, [output, input], [0]),
                                 async_op, input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        check_scatter_pair(output, input, self.world_size, "output", "input")
        return self._exec.submit(lambda: self._run("all_gather", self._all_gather, [output, input], [0]),
                                 async_op, input)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Handle | None:
        check_flat(tensor, "tensor")
        check_src(src, self.world_size)
        return self._exec.submit(lambda: self._run("broadcast", lambda t: self._broadcast(t, src), [tensor], [0]),
                                 async_op, tensor)

    def barrier(self) -> None:
        self._exec.submit(lambda: dist.barrier(group=self.group), False, torch.empty(0))

    def close(self) -> None:
        self._exec.close()

    # ---- the ring itself (communicator thread)

    def _run(self, op: str, fn, tensors: list[torch.Tensor], written: list[int]) -> None:
        self._sent = self._received = 0
        t0 = call_started()
        if tensors[-1].numel() > 0:  # world size 1 runs too: zero ring steps, copy semantics kept
            host, finish = stage_on_host(self.backend, tensors, written)
            fn(*host)
            finish()
        self.traffic.add(op, self._sent, self._received)
        record_call("ring", op, tensors[-1], t0)

    def _step(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send to the next rank, receive from the previous one, and wait for both."""
        for w in exchange(send, self._next, recv, self._prev, self.group, self.backend):
            w.wait()
        self._sent += send.numel() * send.element_size()
        self._received += recv.numel() * recv.element_size()

    def _ring_reduce_scatter(self, chunks: torch.Tensor) -> None:
        """N-1 steps; afterwards chunks[rank] holds the sum over ranks."""
        n, r = self.world_size, self.rank
        incoming = torch.empty_like(chunks[0])
        for s in range(n - 1):
            self._step(chunks[(r - s - 1) % n], incoming)
            chunks[(r - s - 2) % n].add_(incoming)

    def _ring_all_gather(self, chunks: torch.Tensor) -> None:
        """N-1 steps; chunks[rank] travels round the ring until every rank holds every chunk."""
        n, r = self.world_size, self.rank
        for s in range(n - 1):
            self._step(chunks[(r - s) % n], chunks[(r - s - 1) % n])

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        n, numel = self.world_size, tensor.numel()
        c = ring_chunk(numel, n)
        buf = torch.zeros(n * c, dtype=tensor.dtype, device=tensor.device)  # padding: sums of zeros stay zero
        buf[:numel].copy_(tensor)
        chunks = buf.view(n, c)
        self._ring_reduce_scatter(chunks)
        self._ring_all_gather(chunks)
        tensor.copy_(buf[:numel])

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        chunks = input.clone().view(self.world_size, -1)  # the caller's input is left as it was
        self._ring_reduce_scatter(chunks)
        output.copy_(chunks[self.rank])

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        chunks = output.view(self.world_size, -1)
        chunks[self.rank].copy_(input)
        self._ring_all_gather(chunks)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """A chain src -> src+1 -> ... -> src-1: receive the whole tensor, then pass it on."""
        n = self.world_size
        pos = (self.rank - src) % n
        if pos > 0:
            posted(dist.irecv(tensor, self._prev, self.group)).wait()
            self._received += tensor.numel() * tensor.element_size()
        if pos < n - 1:
            posted(dist.isend(tensor, self._next, self.group)).wait()
            self._sent += tensor.numel() * tensor.element_size()
