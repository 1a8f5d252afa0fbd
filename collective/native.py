"""torch.distributed's own collectives behind the Communicator interface, with modelled traffic."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from collective.comm import (Communicator, Handle, call_started, check_flat, check_scatter_pair, check_src, record_call,
                             ring_bytes, stage_on_host)

# torch >= 2.11 renamed the tensor-form collectives; the old names still work but warn on every call.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class NativeCommunicator(Communicator):
    """torch.distributed all_reduce / reduce_scatter / all_gather / broadcast (gloo, NCCL, ...).

    The library cannot see its wire, so each call adds the ring algorithm's volume to a meter marked
    modelled: all_reduce 2(N-1)*C with C = ceil(L/N)*itemsize (the padded chunk, as the ring sends for a
    length not divisible by N), reduce_scatter and all_gather (N-1)*C, broadcast a chain's S per hop.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(group, modelled=True)

    def _issue(self, op: str, numel: int, tensors: list[torch.Tensor],
               call: Callable[..., dist.Work | None], async_op: bool, src: int = 0) -> Handle | None:
        """Count the modelled bytes, run `call` on (host-staged) tensors, wrap its work in a Handle."""
        self.traffic.add(op, *ring_bytes(op, numel, tensors[0].element_size(), self.world_size, self.rank, src))
        host, finish = stage_on_host(self.backend, tensors, [0])
        t0 = call_started()
        work = call(*host, group=self.group, async_op=async_op)
        if not async_op:
            finish()
            record_call("native", op, tensors[-1], t0)
            return None
        if t0 is not None and work is not None:   # a traced step: issued until torch's work completed
            work.get_future().add_done_callback(lambda _: record_call("native", op, tensors[-1], t0))

        def wait() -> None:
            if work is not None:
                work.wait()
            finish()

        return Handle(wait, work.is_completed if work is not None else None)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        check_flat(tensor, "tensor")
        return self._issue("all_reduce", tensor.numel(), [tensor], dist.all_reduce, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        check_scatter_pair(input, output, self.world_size, "input", "output")
        return self._issue("reduce_scatter", input.numel(), [output, input], _reduce_scatter, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        check_scatter_pair(output, input, self.world_size, "output", "input")
        return self._issue("all_gather", input.numel(), [output, input], _all_gather, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Handle | None:
        check_flat(tensor, "tensor")
        check_src(src, self.world_size)
        root = self.global_rank(src)  # torch.distributed names the source by its default-group rank

        def call(t: torch.Tensor, group, async_op: bool) -> dist.Work | None:
            return dist.broadcast(t, src=root, group=group, async_op=async_op)

        return self._issue("broadcast", tensor.numel(), [tensor], call, async_op, src)

    def barrier(self) -> None:
        dist.barrier(group=self.group)
