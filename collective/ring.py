"""The pipelined ring: the plain ring's schedule, with each chunk cut into segments kept in flight."""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from collective.comm import (Communicator, Handle, SerialExecutor, check_flat, check_scatter_pair, check_src,
                             call_started, exchange, posted, record_call, ring_chunk, stage_on_host)
from psarch.timeline import RECORDER

# One ring step: (chunk this rank sends, chunk it receives, whether the received chunk is added or copied).
Step = tuple[int, int, bool]


class RingCommunicator(Communicator):
    """Ring collectives over point-to-point, pipelined in segments so transfers overlap the reduction.

    Segments of `segment_bytes` move through the ring; up to `window` of them are in flight per direction,
    and a segment is sent on to the next rank as soon as it has been reduced. The summation order is the
    plain ring's, so results are bitwise equal to PlainRingCommunicator's. bf16/fp16 are added in their
    own dtype: each ring step adds two values and rounds once, exactly what the plain ring and gloo do, so
    accumulating a step in fp32 would change nothing (the partial sum must be rounded to go on the wire).
    At world size 2, all-reduces of up to one segment swap whole buffers instead (see _swap): same sums,
    same bytes, one round trip. Scratch space is kept from call to call: max(window, 2) segments per dtype.

    Why 4 MiB segments and a window of 4: each message on gloo's point-to-point path costs a rendezvous and
    thread wake-ups, and where ranks share cores CPU is the bound; against 1 MiB segments they cut the ring's
    CPU relative to gloo's (`psarch bench allreduce`), and 4 in flight keep a connection busy while one
    segment is added.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, segment_bytes: int = 4 << 20, window: int = 4) -> None:
        super().__init__(group, modelled=False)
        if segment_bytes <= 0 or window <= 0:
            raise ValueError(f"segment_bytes and window must be positive, got {segment_bytes} and {window}")
        self.segment_bytes = segment_bytes
        self.window = window
        n = self.world_size
        self._next = self.global_rank((self.rank + 1) % n)
        self._prev = self.global_rank((self.rank - 1) % n)
        self._exec = SerialExecutor(f"ring-rank{self.rank}")
        self._spare: dict[torch.dtype, torch.Tensor] = {}  # scratch for the communicator thread, see _scratch

    # ---- public collectives: validate here, run on the communicator thread in FIFO order

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

    # ---- the collectives in ring steps (communicator thread)

    def _run(self, op: str, fn, tensors: list[torch.Tensor], written: list[int]) -> None:
        sent = received = 0
        t0 = call_started()
        if tensors[-1].numel() > 0:  # world size 1 runs too: zero ring steps, copy semantics kept
            host, finish = stage_on_host(self.backend, tensors, written)
            sent, received = fn(*host)
            finish()
        self.traffic.add(op, sent, received)
        record_call("ring", op, tensors[-1], t0)   # as it ran on this thread, its queueing not counted

    def _rs_steps(self) -> list[Step]:
        n, r = self.world_size, self.rank  # after these, chunk r holds the sum (the plain ring's indices)
        return [((r - s - 1) % n, (r - s - 2) % n, True) for s in range(n - 1)]

    def _ag_steps(self) -> list[Step]:
        n, r = self.world_size, self.rank  # chunk r travels round the ring
        return [((r - s) % n, (r - s - 1) % n, False) for s in range(n - 1)]

    def _all_reduce(self, tensor: torch.Tensor) -> tuple[int, int]:
        n = self.world_size
        c = ring_chunk(tensor.numel(), n)
        if n == 2 and 2 * c * tensor.element_size() <= self.segment_bytes:
            return self._swap(tensor, c)
        return self._pipeline(tensor, c, self._rs_steps() + self._ag_steps())

    def _swap(self, tensor: torch.Tensor, c: int) -> tuple[int, int]:
        """World size 2, a buffer of at most one segment: one exchange of whole buffers, not two ring steps.

        The pipeline would overlap little at these sizes; this saves a round trip and moves the same bytes.
        Each rank adds both chunks in the ring's operand order: its own as own + peer's (the reduce step), the
        other as peer's + own (the sum the peer would send back in the gather step): bitwise the ring's sums.
        """
        numel = tensor.numel()
        space = self._scratch(4 * c, tensor)
        incoming, buf = space[:2 * c], (tensor if numel == 2 * c else space[2 * c:])
        if buf is not tensor:  # padded to two equal chunks
            buf[:numel].copy_(tensor)
            buf[numel:].zero_()
        for work in exchange(buf, self._next, incoming, self._prev, self.group, self.backend):
            work.wait()
        mine, other = slice(self.rank * c, (self.rank + 1) * c), slice((1 - self.rank) * c, (2 - self.rank) * c)
        buf[mine].add_(incoming[mine])
        torch.add(incoming[other], buf[other], out=buf[other])
        if buf is not tensor:
            tensor.copy_(buf[:numel])
        nbytes = buf.numel() * buf.element_size()
        return nbytes, nbytes

    def _scratch(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A host buffer kept from call to call: a fresh one faults its pages in every time (ms per 8 MiB)."""
        if like.is_cuda:  # the caching allocator reuses memory already, and knows about streams
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        spare = self._spare.get(like.dtype)
        if spare is None or spare.numel() < numel:
            spare = self._spare[like.dtype] = torch.empty(numel, dtype=like.dtype)
        return spare[:numel]

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> tuple[int, int]:
        c = output.numel()
        buf = input.clone()  # the caller's input is left as it was
        counts = self._pipeline(buf, c, self._rs_steps())
        output.copy_(buf[self.rank * c:(self.rank + 1) * c])
        return counts

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> tuple[int, int]:
        c = input.numel()
        output[self.rank * c:(self.rank + 1) * c].copy_(input)
        return self._pipeline(output, c, self._ag_steps())

    def _segments(self, numel: int, itemsize: int) -> list[tuple[int, int]]:
        seg = max(1, self.segment_bytes // itemsize)
        return [(lo, min(numel, lo + seg)) for lo in range(0, numel, seg)]

    def _pipeline(self, buf: torch.Tensor, c: int, steps: Sequence[Step]) -> tuple[int, int]:
        """Run ring steps over buf's chunks of c elements, segment by segment; returns bytes (sent, received).

        buf counts as zero-padded to n * c elements (_PaddedChunks: segments past its end are worked on in padded
        copies, written back at the end, so the tensor itself is never copied whole).

        Unit u = (step u // K, segment u % K). Its send needs unit u - K (the same segment one step earlier)
        received and reduced; posting unit u + W right after finishing unit u, with W <= K, guarantees that,
        and sends each segment on as soon as it is ready when W = K.
        """
        if not steps:  # world size 1
            return 0, 0
        bounds = self._segments(c, buf.element_size())
        k = len(bounds)
        units = len(steps) * k
        w = min(k, self.window)
        seg = bounds[0][1]
        incoming = self._scratch(w * seg, buf) if steps[0][2] else buf.new_empty(0)   # no step reduces: unused
        in_flight: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        reading: dict[tuple[int, int], list[dist.Work]] = {}  # sends still reading a region of buf
        chunks = _PaddedChunks(buf, c, bounds)
        sent = received = 0
        posted_at: dict[int, float] = {}   # a traced step's units: when each was posted (psarch.timeline)

        def post(u: int) -> None:
            nonlocal sent, received
            if RECORDER.on:
                posted_at[u] = time.perf_counter()
            s, j = divmod(u, k)
            send_chunk, recv_chunk, reduce = steps[s]
            out = chunks.region(send_chunk, j)
            if reduce:  # received into a window slot, then added; the slot's last user was unit u - w
                slot = u % w
                into = incoming[slot * seg:slot * seg + out.numel()]
            else:  # received in place, once this rank's earlier sends from there have gone
                into = chunks.region(recv_chunk, j)
                for work in reading.pop((recv_chunk, j), []):
                    work.wait()
            send_work, recv_work = exchange(out, self._next, into, self._prev, self.group, self.backend)
            reading.setdefault((send_chunk, j), []).append(send_work)
            in_flight[u] = (recv_work, into)
            sent += out.numel() * out.element_size()
            received += into.numel() * into.element_size()

        for u in range(w):
            post(u)
        for u in range(units):
            recv_work, into = in_flight.pop(u)
            recv_work.wait()
            s, j = divmod(u, k)
            if steps[s][2]:
                chunks.region(steps[s][1], j).add_(into)
            if u in posted_at:   # a ring step from its post to its chunk received (and added)
                RECORDER.add("ring steps", f"step {s}.{j} {into.numel() * into.element_size()} B", posted_at.pop(u),
                             time.perf_counter())
            if u + w < units:
                post(u + w)
        for works in reading.values():
            for work in works:
                work.wait()
        chunks.write_back()
        return sent, received

    def _broadcast(self, tensor: torch.Tensor, src: int) -> tuple[int, int]:
        """A chain src -> src+1 -> ... -> src-1, each segment passed on as soon as it has arrived."""
        n = self.world_size
        pos = (self.rank - src) % n
        bounds = self._segments(tensor.numel(), tensor.element_size())
        w = min(len(bounds), self.window)
        recvs: dict[int, dist.Work] = {}
        sends: list[dist.Work] = []
        sent = received = 0

        def post_recv(j: int) -> None:
            nonlocal received
            lo, hi = bounds[j]
            recvs[j] = posted(dist.irecv(tensor[lo:hi], self._prev, self.group))
            received += (hi - lo) * tensor.element_size()

        if pos > 0:
            for j in range(w):
                post_recv(j)
        for j, (lo, hi) in enumerate(bounds):
            if pos > 0:
                recvs.pop(j).wait()
                if j + w < len(bounds):
                    post_recv(j + w)
            if pos < n - 1:
                sends.append(posted(dist.isend(tensor[lo:hi], self._next, self.group)))
                sent += (hi - lo) * tensor.element_size()
        for work in sends:
            work.wait()
        return sent, received


class _PaddedChunks:
    """A buffer seen as chunks of c elements cut into segments (bounds), zero-padded to whole chunks: a segment
    reaching past its end is worked on in a padded copy, written back by write_back, so the buffer itself is
    never copied whole."""

    def __init__(self, buf: torch.Tensor, c: int, bounds: list[tuple[int, int]]) -> None:
        self.buf, self.c, self.bounds = buf, c, bounds
        self.padded: dict[int, torch.Tensor] = {}  # start -> padded copy of a segment past buf's end

    def region(self, chunk: int, j: int) -> torch.Tensor:
        """Segment j of chunk `chunk`: a view of the buffer, or its padded copy."""
        buf = self.buf
        lo, hi = chunk * self.c + self.bounds[j][0], chunk * self.c + self.bounds[j][1]
        if hi <= buf.numel():
            return buf[lo:hi]
        if lo not in self.padded:
            self.padded[lo] = torch.zeros(hi - lo, dtype=buf.dtype, device=buf.device)
            self.padded[lo][:len(buf[lo:])].copy_(buf[lo:])  # empty past the end: all padding
        return self.padded[lo]

    def write_back(self) -> None:
        """The padded copies' parts within the buffer, into it."""
        for lo, part in self.padded.items():
            self.buf[lo:].copy_(part[:len(self.buf[lo:])])
