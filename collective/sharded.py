"""Row-sharded embedding tables exchanged by all-to-all (`backend.embeddings = "sharded"`, ddp only), the
model-parallel answer TorchRec uses; the dense layers stay data-parallel in collective/ddp.py.

Rank r owns rows [r·B, (r+1)·B) of every table, B = ceil(rows / N): a range of row ids, not a hash, so the
owner of an id is one division, a shard is one contiguous slice of the table (the export is a concatenation,
and a checkpoint fragment is one flat range of the table), and the clicks data already scatters hot ids over
the table by a seeded permutation, so a range spreads them as evenly as a hash would. A step:
  forward:  each rank sends its batch's unique ids (per table) to their owners by all_to_all_single (the
            counts first), the owners answer with the rows, the rank pools them in the model's forward;
  backward: the gradients of those rows go back to their owners by all-to-all, the owners sum them, divide by
            N (the mean over ranks, as the dense all-reduce does) and update their shard.
The shard is updated whole, with a zero gradient on the rows no rank touched: for SGD without momentum or
weight decay and for Adagrad without weight decay those rows do not move anyway, and for AdamW, momentum or
weight decay they move exactly as in the dense update (an AdamW row keeps drifting on its moments), so every
optimizer equals `single`, at the price of an O(shard) update per step.
At start-up the model's tables are on the meta device (the spec's worker_holds_tables) and each rank asks the
model for its own rows' initial values (`model.initial_rows`, e.g. psarch/models/dlrm.py): no rank ever holds,
or broadcasts, the whole tables.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from collective.comm import Communicator, stage_on_host
from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import Fragment, fragments_in, restore_optimizer
from psarch.meters import TrafficMeter, tensor_bytes
from psarch.config import Config
from psarch.embeddings import EmbeddingTables, batch_ids, embedding_tables
from psarch.precision import MixedPrecisionOptimizer, compute_dtype
from psarch.trainer import OpTraffic

ID_BYTES = 8    # ids travel as int64


def rows_per_rank(rows: int, world_size: int) -> int:
    """B, the rows of a table each rank holds: ceil(rows / N) (the last shard's tail is padding)."""
    return -(-rows // world_size)


def owners(ids: torch.Tensor, rows: int, block: int) -> torch.Tensor:
    """The rank that owns each id, id // B; an id outside the table is refused before anything moves."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise ValueError(f"ids from {int(ids.min())} to {int(ids.max())}: a table has rows 0 to {rows - 1}")
    return torch.div(ids, block, rounding_mode="floor")


class PooledRows(nn.Module):
    """Stands in for one table's nn.EmbeddingBag: pools the rows fetched from their owners for this batch."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        if mode not in ("mean", "sum"):
            raise ValueError(f"EmbeddingBag mode {mode!r}: sharded embeddings pool by 'mean' or 'sum'")
        self.mode = mode
        self.fetched: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.fetched is None:
            raise RuntimeError("sharded table: forward before ShardedTables.fetch(batch) brought its rows")
        expected, rows, inverse = self.fetched
        if ids is not expected and not torch.equal(ids, expected):
            raise RuntimeError("sharded table: forward got other ids than the batch whose rows were fetched")
        bags = rows[inverse].view(*ids.shape, rows.shape[-1])
        return bags.mean(-2) if self.mode == "mean" else bags.sum(-2)


class ShardedTables(EmbeddingTables):
    """The embedding tables of a model, row-sharded over the ranks of `comm`: takes them out of the model
    (the model keeps PooledRows in their place), holds this rank's shard of each, and moves rows by all-to-all."""

    name = "sharded"

    def __init__(self, model: nn.Module, comm: Communicator, cfg: Config, device: torch.device) -> None:
        """The model's tables are on meta: this rank builds only its own rows, from `model.initial_rows`."""
        initial_rows = getattr(model, "initial_rows", None)
        if initial_rows is None:
            raise ValueError(f"backend.embeddings = \"sharded\": {type(model).__name__} cannot build a range of its "
                             f"tables' rows (no initial_rows(table, start) method, as the dlrm model has)")
        tables = embedding_tables(model)
        shapes = {tuple(t.weight.shape) for _, t in tables}
        if len(shapes) != 1:
            raise ValueError(f"sharded embeddings need tables of one shape, got {sorted(shapes)}")
        self.comm, self.n, self.rank = comm, comm.world_size, comm.rank
        self.names = [name for name, _ in tables]
        self.rows, self.dim = shapes.pop()
        self.block = rows_per_rank(self.rows, self.n)
        lo, hi = self._range(self.rank)
        # (tables, B, dim): one tensor, so one fused optimizer step and one all-gather serve every table
        self.shard = torch.zeros(len(tables), self.block, self.dim, dtype=compute_dtype(cfg.train.precision),
                                 device=device)
        for i in range(len(tables)):   # rows [lo, hi), a block at a time; the last shard's padding stays zero
            pos = 0
            for chunk in initial_rows(i, start=lo):
                take = min(chunk.shape[0], hi - lo - pos)
                self.shard[i, pos:pos + take] = chunk[:take]
                pos += take
                if pos == hi - lo:
                    break
        self.grad = torch.zeros_like(self.shard)
        self.pooled = [PooledRows(t.mode if isinstance(t, nn.EmbeddingBag) else "sum") for _, t in tables]
        held = model.tables
        assert isinstance(held, nn.ModuleList)   # embedding_tables found the tables there
        for i, p in enumerate(self.pooled):   # the whole tables leave the model: only the shard stays
            held[i] = p
        self.optim = MixedPrecisionOptimizer([self.shard], cfg.train, cfg.train.precision)
        self.meter = TrafficMeter(modelled=True)   # torch's all_to_all_single: the payload's volume
        self._step: dict[str, Any] = {}

    def _range(self, rank: int) -> tuple[int, int]:
        """Rows [lo, hi) of every table that `rank` owns."""
        return min(rank * self.block, self.rows), min((rank + 1) * self.block, self.rows)

    def _all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    width: int = 1) -> torch.Tensor:
        """all_to_all_single of rows of `width` elements; counts the bytes that leave and reach this rank."""
        recv = send.new_empty(sum(recv_splits), *send.shape[1:])
        item = send.element_size() * width
        self.meter.add("all_to_all", (sum(send_splits) - send_splits[self.rank]) * item,
                         (sum(recv_splits) - recv_splits[self.rank]) * item)
        (out, inp), finish = stage_on_host(self.comm.backend, [recv, send.contiguous()], [0])
        dist.all_to_all_single(out, inp, recv_splits, send_splits, group=self.comm.group)
        finish()
        return recv

    def fetch(self, batch: Any) -> Any:
        """Forward's exchange: send the batch's unique ids to their owners, get their rows back, hand them to
        the model's PooledRows (the step's id counts come back from exchange)."""
        ids = batch_ids(batch)
        tables, n = len(self.pooled), self.n
        uniq, inverse = zip(*(torch.unique(ids[:, t], return_inverse=True) for t in range(tables)))
        flat = torch.cat(uniq)
        table = torch.repeat_interleave(torch.arange(tables, device=flat.device),
                                        torch.tensor([len(u) for u in uniq], device=flat.device))
        owner = owners(flat, self.rows, self.block)
        # owner-major, then table, then id: the order the owners answer in (stable keeps ids sorted)
        order = torch.sort(owner * tables + table, stable=True).indices
        send_counts = torch.bincount(owner * tables + table, minlength=n * tables).view(n, tables)
        recv_counts = self._all_to_all(send_counts.reshape(-1), [tables] * n, [tables] * n).view(n, tables)
        send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        asked = self._all_to_all(flat[order], send_splits, recv_splits)
        asked_table = torch.repeat_interleave(torch.arange(tables, device=flat.device).repeat(n),
                                              recv_counts.reshape(-1))
        local = asked - self.rank * self.block
        answer = self.shard[asked_table, local]
        got = self._all_to_all(answer, recv_splits, send_splits, width=self.dim)
        rows = torch.empty_like(got)
        rows[order] = got
        rows.requires_grad_(True)   # a leaf: backward leaves each fetched row's gradient in rows.grad
        for t, (p, piece) in enumerate(zip(self.pooled, rows.split([len(u) for u in uniq]))):
            p.fetched = (ids[:, t], piece, inverse[t])
        self._step = {"rows": rows, "order": order, "send_splits": send_splits, "recv_splits": recv_splits,
                      "asked_table": asked_table, "local": local,
                      "counts": {"unique_ids": len(flat), "ids_out": sum(send_splits) - send_splits[self.rank],
                                 "ids_in": sum(recv_splits) - recv_splits[self.rank]}}
        return batch

    def exchange(self, batch: Any, grads: list[torch.Tensor]) -> dict[str, int]:
        """Backward's exchange: send each fetched row's gradient to its owner, who sums them into the shard's
        gradient divided by N (zero on rows no rank touched). Returns this step's ids: unique in the batch (all
        tables), sent to other owners, asked of this rank by others."""
        s = self._step
        rows = s["rows"]
        g = rows.grad if rows.grad is not None else torch.zeros_like(rows)
        got = self._all_to_all(g[s["order"]], s["send_splits"], s["recv_splits"], width=self.dim)
        self.grad.zero_()
        self.grad.index_put_((s["asked_table"], s["local"]), got, accumulate=True)
        self.grad.div_(self.n)
        for p in self.pooled:
            p.fetched = None
        return dict(s["counts"])

    def step(self) -> bool:
        """Update the whole shard with its optimizer (see the module's docstring); True if skipped."""
        return self.optim.step([self.grad])

    def traffic(self) -> dict[str, OpTraffic]:
        return self.meter.report().ops

    def modelled(self) -> bool:
        return True

    def full_tables(self) -> dict[str, torch.Tensor]:
        """The whole fp32 tables, by parameter name, from every rank's shard (an all-gather; a collective call)."""
        master = self.optim.master.masters[0].detach().reshape(-1).contiguous()
        out = master.new_empty(self.n * master.numel())
        with self.comm.traffic.tagged("export"):
            self.comm.all_gather(out, master)
        whole = out.view(self.n, len(self.names), self.block, self.dim).transpose(0, 1)
        whole = whole.reshape(len(self.names), self.n * self.block, self.dim)[:, :self.rows]
        return {name: whole[i].to("cpu", copy=True) for i, name in enumerate(self.names)}

    def fragments(self) -> list[Fragment]:
        """This rank's rows of each table, as checkpoint fragments (flat ranges of `tables.t.weight`)."""
        lo, hi = self._range(self.rank)
        opt, masters = self.optim.optimizer, self.optim.master.params
        per = self.block * self.dim
        return [f for i, name in enumerate(self.names)
                for f in fragments_in(opt, masters, 0, [(name, torch.Size((self.rows, self.dim)), 0)],
                                      lo * self.dim, hi * self.dim, base=i * per)]

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        restore_optimizer(self.optim, ckpt, self.fragments)

    def params(self) -> dict[str, tuple[int, ...]]:
        """Each table's parameter name and whole shape (what a checkpoint records)."""
        return {name: (self.rows, self.dim) for name in self.names}

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for its shard, by category, and how many of them are padding rows."""
        lo, hi = self._range(self.rank)
        pad_elems = len(self.names) * (self.block - (hi - lo)) * self.dim
        per_elem = 2 * self.shard.element_size() + self.optim.state_bytes_per_element()
        return {"params": tensor_bytes([self.shard]), "grads": tensor_bytes([self.grad]),
                "optimizer": self.optim.state_bytes(), "padding": pad_elems * per_elem}

    def summary(self) -> dict[str, float]:
        """Embedding bytes this rank holds (its shard, padding included) against the whole tables'."""
        return {"embedding_bytes": tensor_bytes([self.shard]),
                "table_bytes": len(self.names) * self.rows * self.dim * self.shard.element_size()}
