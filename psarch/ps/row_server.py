"""A parameter server that also holds a shard of the embedding tables by row (`backend.embeddings = "rows"`).

The dense parameters are served exactly as by ParameterServer (flat ranges, push/pull/pushpull). The
rows of the tables that this server owns (psarch/ps/rows.py: key k mod servers = index) move in three
more requests:

- `rowpull` (the tensor: the int64 keys a worker's next step reads) -> `rows` (their values, in the
  wire dtype), answered at once: a worker sends it after its pull for that step was answered, so the
  mode's wait (sync round, SSP bound) has already happened;
- `rowpush` (keyed: keys + their rows' gradients; geo: deltas) for the worker's next step, sent before
  that step's dense push on the same connection, so ZeroMQ delivers it first: when a sync round's last
  dense push arrives, every row of the round is in. Sync sums the round's rows over workers and applies
  the mean once with the dense update; async / ssp apply each push at once (row-wise optimizer, no
  staleness compensation); geo adds each worker's row deltas at once (or, with the barrier, the round's);
- `rowfetch` -> `rows`: this server's whole shard in fp32 (the final model).

Keys must be int64, one-dimensional, strictly increasing and owned by this server; values must be the
wire dtype, one row of `dim` per key, finite. Anything else is an error reply and changes nothing.
"""
from __future__ import annotations

from typing import Any

import torch

from psarch.config import Config
from psarch.ps import wire
from psarch.ps.errors import NonFinitePush, PSError
from psarch.ps.layout import _SEED_LOCK
from psarch.ps.row_snapshot import RowSnapshots
from psarch.ps.rows import RowShard, dense_flat, initial_shard, key_space
from psarch.ps.server import ParameterServer


class RowServer(RowSnapshots, ParameterServer):
    """ParameterServer for the dense ranges plus one RowShard of the embedding tables (checkpointed by
    RowSnapshots: psarch/ps/row_snapshot.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.space = key_space(self.cfg)
        self.shard: RowShard | None = None
        self.row_step = [-1] * self.workers    # the step of each worker's last rowpush

    def initialize_model(self, dense: torch.Tensor, rows: torch.Tensor) -> None:
        """Start from the initial dense flat vector and this server's rows (rows.initial_shard)."""
        self.initialize(dense)
        self.shard = RowShard(rows, self.space, self.index, self.cfg)

    def _on_init(self, ident: bytes, msg: wire.Message) -> None:
        raise PSError("init: a server with embedding rows builds its initial model from the config")

    def _on_rowpull(self, ident: bytes, msg: wire.Message) -> None:
        w = self._worker(msg)
        if msg.header["want"] != self.wire_dtype:
            raise PSError(f"rowpull: dtype {msg.header['want']!r:.40}, this run's wire dtype is {self.wire_dtype}")
        idx = self.shard.local(msg.tensor(), "rowpull")
        self._send(ident, "rowpull", {"op": "rows", "version": self.state.version},
                   self.shard.gather(idx, self.scratch.dtype))

    def _on_rowpush(self, ident: bytes, msg: wire.Message) -> None:
        w, h, st = self._worker(msg), msg.header, self.state
        if h["version"] != st.sent_version[w]:
            raise PSError(f"rowpush: worker {w} says it computed on version {h['version']}, this server last "
                          f"sent it version {st.sent_version[w]}")
        if h["step"] != self.clock[w] or self.row_step[w] == h["step"]:
            raise PSError(f"rowpush: worker {w} sent rows for step {h['step']}; its next step is {self.clock[w]}"
                          + (" and it has pushed its rows for it" if self.row_step[w] == self.clock[w] else ""))
        if self.barrier and (h["step"] != st.version or w in self.round_pushed):
            # its rows would join the round of step st.version as if they were that step's
            raise PSError(f"rowpush: worker {w} sent rows for step {h['step']} during the round of step {st.version}"
                          + (", after its dense push for it" if w in self.round_pushed else ""))
        if h["dtype"] != self.wire_dtype or msg.shape[1] != self.space.dim:
            raise PSError(f"rowpush: values {h['dtype']} {list(msg.shape)}: expected {self.wire_dtype} "
                          f"[keys, {self.space.dim}]")
        idx = self.shard.local(msg.keys(), "rowpush")
        try:
            values = msg.tensor(finite=True)
        except wire.NonFinitePayload:
            self.refused_non_finite[w] += 1
            raise NonFinitePush(f"rowpush: worker {w}'s rows for step {h['step']} hold inf/nan: refused, "
                                f"nothing applied") from None
        self.changing = True
        if self.barrier:
            self.shard.add_to_round(w, idx, values)
        else:
            # geo: workers divide their deltas by N; after a loss, the mean over the live workers' deltas
            self.shard.apply(idx, values, self.workers / len(self._live()))
        self.row_step[w] = h["step"]
        self._send(ident, "rowpush", {"op": "ack", "version": st.version})

    def _complete_round(self) -> None:
        if self.barrier and self.round_pushed and self.round_pushed >= self._live():
            # sync: the mean gradient over all N workers, as the dense range; geo: deltas arrive divided by N
            self.shard.apply_round(1 / self.workers if self.mode == "sync" else self.workers / len(self.round_pushed))
        super()._complete_round()

    def _lose(self, w: int, why: str) -> None:
        # a worker lost between its rowpush and its dense push is not in the round: nor are its rows
        if self.shard is not None and w not in self.lost and w not in self.round_pushed:
            self.shard.drop(w)
        super()._lose(w, why)

    def _on_rowfetch(self, ident: bytes, msg: wire.Message) -> None:
        self._worker(msg)
        self._send(ident, "rowfetch", {"op": "rows", "version": self.state.version}, self.shard.rows.clone())

    def _control(self, cmd: dict[str, Any]) -> None:
        if cmd.get("cmd") != "stats":
            return super()._control(cmd)
        # the launcher's model.pt: this server's dense range, then its rows (rows.join_parts splits them)
        self._notify({"event": "stats", **self.stats()})
        both = torch.cat([self.state.params.detach().reshape(-1), self.shard.rows.reshape(-1)])
        self.control.send_bytes(memoryview(both.numpy()).cast("B"))

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        rows = self.shard.memory()
        mem = out["memory"]
        for k, v in rows.items():
            mem[k] = mem.get(k, 0) + v
        mem["total"] = sum(mem[k] for k in ("params", "optimizer", "buffers"))
        mem["embedding_rows"] = self.shard.rows.shape[0]
        mem["embedding_bytes"] = rows["params"]
        return out


def row_server(index: int, cfg: Config, host: str, port: int, **kwargs: Any) -> RowServer:
    """A RowServer holding its part of the initial model, built from the config as every worker builds it."""
    from psarch.workload import click_model
    if cfg.train.precision != "fp32":
        raise ValueError(f"train.precision = {cfg.train.precision!r}: embedding rows run in fp32 only")
    with _SEED_LOCK:  # click_model seeds torch's global generator: servers run as threads take turns
        dense = dense_flat(click_model(cfg))   # its tables stay on meta: the shard is built alone, below
    # a rowpush may carry up to every row of the tables: cap frames at a whole chunk, not the dense range
    server = RowServer(index, cfg, host, port, numel=None, **kwargs)
    server.initialize_model(dense, initial_shard(cfg, server.space, index))
    return server
