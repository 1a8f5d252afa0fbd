"""A parameter server's shard of the embedding tables by row (`backend.embeddings = "rows"`), a part the server
holds beside its dense range (served exactly as without rows: flat ranges, push/pull/pushpull). The
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

The hybrid's servers (`tables_only`: a collective backend with backend.embeddings = "ps", collective/ps_tables.py)
hold rows and no dense range: the ranks all-reduce the dense part among themselves. A round is then the rows'
own: `rowpush` names the round (`step`), the round is applied (the mean over workers, once) when every live
worker's rowpush for it is in, and a `rowpull` for step s waits until round s - 1 is applied.

Keys must be int64, one-dimensional, strictly increasing and owned by this server; values must be the
wire dtype, one row of `dim` per key, finite. Anything else is an error reply and changes nothing.
A server with rows builds its initial model from the config: `init` is refused. Its checkpoint part holds
its shard of every table (the format: psarch/ps/row_snapshot.py); the hybrid's server writes it when every rank
asks `save` for step K, each having pushed its rows of rounds 0 .. K - 1 (so round K - 1 is applied and no row of
round K is in), and starts from a checkpoint with K rounds applied.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import PARAM, Pieces, optimizer_views
from psarch.ps.layout import Layout
from psarch.ps import wire
from psarch.ps.errors import NonFinitePush, PSError
from psarch.ps.row_snapshot import ROW_STEP, row_model_layout, shard_fragments
from psarch.ps.rows import key_space
from psarch.ps.server.replies import Replies
from psarch.ps.server.row_shard import RowShard
from psarch.ps.server.state import ServerState
from psarch.ps.server.updates import NonFiniteUpdate

Handler = Callable[[bytes, wire.Message], None]


class ServerRows:
    """The rows part of a server: its RowShard, the row requests, and what rows add to a round, a lost worker,
    the server's measurements and its checkpoint part."""

    def __init__(self, state: ServerState, replies: Replies, tables_only: bool = False) -> None:
        self.state, self.replies, self.tables_only = state, replies, tables_only
        self.rounds = 0                          # tables only: the row rounds applied
        self.round_pushed: set[int] = set()      # tables only: who pushed rows for round `rounds`
        # tables only: rowpulls and rowfetches waiting for the round in progress to be applied
        self.waiting: list[tuple[Handler, bytes, wire.Message]] = []
        self.space = key_space(state.cfg)
        self.shard: RowShard | None = None
        self.row_step = [-1] * state.workers    # the step of each worker's last rowpush
        self._layout: tuple[Layout, list[str]] | None = None

    def start(self, rows: torch.Tensor) -> None:
        """Hold this server's rows of the initial tables (psarch/ps/server/row_shard.py's initial_shard)."""
        self.shard = RowShard(rows, self.space, self.state.index, self.state.cfg)

    @property
    def held(self) -> RowShard:
        """The shard `start` gave this server, before it answers any request."""
        if self.shard is None:
            raise RuntimeError("ServerRows: its rows are used before start() gave them")
        return self.shard

    def handlers(self) -> dict[str, Handler]:
        """The requests this part answers (and `init`, which a server with rows refuses)."""
        return {"init": self.on_init, "rowpull": self.on_rowpull, "rowpush": self.on_rowpush,
                "rowfetch": self.on_rowfetch}

    def on_init(self, ident: bytes, msg: wire.Message) -> None:
        raise PSError("init: a server with embedding rows builds its initial model from the config")

    def on_rowpull(self, ident: bytes, msg: wire.Message) -> None:
        s = self.state
        w = s.sender(msg)
        if self.tables_only and msg.header["step"] != self.rounds:
            if msg.header["step"] != self.rounds + 1 or w not in self.round_pushed:
                raise PSError(f"rowpull: worker {w} asks the rows of step {msg.header['step']}; this server has "
                              f"applied {self.rounds} rounds" + ("" if w in self.round_pushed else
                                                                 " and has not its rows for the next"))
            self.waiting.append((self._answer_pull, ident, msg))   # answered once round `step - 1` is applied
            return
        self._answer_pull(ident, msg)

    def _answer_pull(self, ident: bytes, msg: wire.Message) -> None:
        s = self.state
        if msg.header["want"] != s.wire_dtype:
            raise PSError(f"rowpull: dtype {msg.header['want']!r:.40}, this run's wire dtype is {s.wire_dtype}")
        idx = self.held.local(msg.tensor(), "rowpull")
        self.replies.send(ident, "rowpull", {"op": "rows", "version": s.version},
                          self.held.gather(idx, wire.DTYPES[s.wire_dtype]))

    def on_rowpush(self, ident: bytes, msg: wire.Message) -> None:
        if self.tables_only:
            return self._table_push(ident, msg)
        s, h = self.state, msg.header
        w = s.sender(msg)
        # with partitions: the server's version and clock are its partitions' least (all alike between steps)
        sent, pushed, version = s.sent_version(w), s.pushed(w), s.version
        if h["version"] != sent:
            raise PSError(f"rowpush: worker {w} says it computed on version {h['version']}, this server last "
                          f"sent it version {sent}")
        if h["step"] != pushed or self.row_step[w] == h["step"]:
            raise PSError(f"rowpush: worker {w} sent rows for step {h['step']}; its next step is {pushed}"
                          + (" and it has pushed its rows for it" if self.row_step[w] == pushed else ""))
        if s.barrier and (h["step"] != version or s.in_round(w)):
            # its rows would join the round of step `version` as if they were that step's
            raise PSError(f"rowpush: worker {w} sent rows for step {h['step']} during the round of step {version}"
                          + (", after its dense push for it" if s.in_round(w) else ""))
        shape = msg.tensor_shape()
        if h["dtype"] != s.wire_dtype or shape[1] != self.space.dim:
            raise PSError(f"rowpush: values {h['dtype']} {list(shape)}: expected {s.wire_dtype} "
                          f"[keys, {self.space.dim}]")
        idx = self.held.local(msg.keys(), "rowpush")
        try:
            values = msg.tensor(finite=True)
        except wire.NonFinitePayload:
            s.refused_non_finite[w] += 1
            raise NonFinitePush(f"rowpush: worker {w}'s rows for step {h['step']} hold inf/nan: refused, "
                                f"nothing applied") from None
        s.changing = True
        if s.barrier:
            self.held.add_to_round(w, idx, values)
        else:
            try:   # geo: workers divide their deltas by N; after a loss, the mean over the live workers' deltas
                self.held.apply(idx, values, s.workers / len(s.live))
            except NonFiniteUpdate as e:
                s.refused_non_finite[w] += 1
                raise NonFinitePush(f"rowpush: worker {w}'s rows for step {h['step']}: {e}: refused, "
                                    f"nothing applied") from None
        self.row_step[w] = h["step"]
        self.replies.send(ident, "rowpush", {"op": "ack", "version": version})

    def _table_push(self, ident: bytes, msg: wire.Message) -> None:
        """Tables only: worker w's rows' gradients for round `step`, kept; the last of the round's applies it
        (the mean over workers, summed in worker order) and answers the rowpulls that waited for it."""
        s, h = self.state, msg.header
        w = s.sender(msg)
        if h["step"] != self.rounds or w in self.round_pushed:
            raise PSError(f"rowpush: worker {w} sent rows for step {h['step']}; the round in progress is step "
                          f"{self.rounds}" + (" and it has pushed its rows for it" if w in self.round_pushed else ""))
        values = self._values(w, msg)
        idx = self.held.local(msg.keys(), "rowpush")
        s.changing = True
        self.held.add_to_round(w, idx, values)
        self.round_pushed.add(w)
        self.replies.send(ident, "rowpush", {"op": "ack", "version": self.rounds})
        if self.round_pushed >= s.live:
            self.held.apply_round(1 / s.workers)
            self.rounds += 1
            self.round_pushed = set()
            waiting, self.waiting = self.waiting, []
            for answer, i, m in waiting:
                answer(i, m)

    def _values(self, w: int, msg: wire.Message) -> "torch.Tensor":
        """A rowpush's checked values: the wire dtype, one row of dim per key, finite."""
        s, h = self.state, msg.header
        shape = msg.tensor_shape()
        if h["dtype"] != s.wire_dtype or shape[1] != self.space.dim:
            raise PSError(f"rowpush: values {h['dtype']} {list(shape)}: expected {s.wire_dtype} "
                          f"[keys, {self.space.dim}]")
        try:
            return msg.tensor(finite=True)
        except wire.NonFinitePayload:
            s.refused_non_finite[w] += 1
            raise NonFinitePush(f"rowpush: worker {w}'s rows for step {h['step']} hold inf/nan: refused, "
                                f"nothing applied") from None

    def on_rowfetch(self, ident: bytes, msg: wire.Message) -> None:
        self.state.sender(msg)
        if self.tables_only and self.round_pushed:   # the final model: after the round in progress
            self.waiting.append((self._fetch, ident, msg))
            return
        self._fetch(ident, msg)

    def _fetch(self, ident: bytes, msg: wire.Message) -> None:
        self.replies.send(ident, "rowfetch", {"op": "rows", "version": self.state.version},
                          self.held.rows.clone())

    def first_to_complete(self, step: int) -> bool:
        """Whether a partition completing barrier round `step` is the first of this server's to do so: the round's
        rows go with it (every row of the round is in: a worker sends them before its dense pushes)."""
        return all(p.range.version == step for p in self.state.parts)

    def round_update(self, factor: float) -> Any:
        """A barrier round is complete: its rows' update, summed over workers, times `factor`, computed and checked
        finite (NonFiniteUpdate) but not applied: `end_round` applies it."""
        return self.held.round_update(factor)

    def end_round(self, update: Any) -> None:
        self.held.end_round(update)

    def drop(self, w: int) -> None:
        """Worker w is lost: lost between its rowpush and its dense push, it is not in the round, nor its rows."""
        if self.shard is not None and w not in self.state.lost and not self.state.in_round(w):
            self.shard.drop(w)

    def most_bytes(self) -> int:
        """The largest legitimate row message to or from this server: every row it owns, with its key."""
        return self.shard.rows.shape[0] * (8 + 4 * self.space.dim) if self.shard is not None else 0

    def add_memory(self, mem: dict[str, Any]) -> None:
        """The shard's bytes added to the server's memory report (and its rows, and their bytes, apart)."""
        rows = self.held.memory()
        for k, v in rows.items():
            mem[k] = mem.get(k, 0) + v
        mem["total"] = sum(mem[k] for k in ("params", "optimizer", "buffers"))
        mem["embedding_rows"] = self.held.rows.shape[0]
        mem["embedding_bytes"] = rows["params"]

    def final(self, dense: torch.Tensor) -> torch.Tensor:
        """What the launcher's model.pt takes from this server: its dense range, then its rows
        (psarch/ps/rows.py's join_parts splits them)."""
        return torch.cat([dense.reshape(-1), self.held.rows.reshape(-1)])

    # ------------------------------------------------------------------ checkpoints

    def _model_layout(self) -> tuple[Layout, list[str]]:
        if self._layout is None:   # built once, on the meta device
            self._layout = row_model_layout(self.state.cfg)
        return self._layout

    def dense_layout(self) -> Layout:
        """The dense parameters' layout in the dense flat vector, without the tables."""
        return self._model_layout()[0]

    @property
    def table_names(self) -> list[str]:
        return self._model_layout()[1]

    def check_save(self, w: int, step: int) -> None:
        """Tables only: worker w may ask for checkpoint `step` once it has pushed its rows of rounds 0 .. step - 1
        (the last applied, or waiting for the other workers' rows): the part is written once every live worker
        asked, so after round step - 1 is applied and before any row of round `step` arrives."""
        pushed = self.rounds + (w in self.round_pushed)
        if pushed != step:
            raise PSError(f"save: worker {w} has pushed the rows of {pushed} round(s); a checkpoint at step {step} "
                          f"follows {step}")

    def _table_scalars(self) -> dict[str, float]:
        """The dense optimizer's numbers (its step), which a dense backend forking from the tables needs (tables
        only: AdamW's step is the rounds applied, one a step)."""
        if self.tables_only:
            return {"step": float(self.rounds)} if self.state.cfg.train.optimizer == "adamw" else {}
        st = self.state.parts[0].range   # every partition of the dense range has stepped as often
        return optimizer_views(st.optim.optimizer, st.optim.master.params[0])[1] if st.optim is not None else {}

    def _tensors(self) -> dict[str, torch.Tensor]:
        sh = self.held
        out = {PARAM: sh.rows}
        if sh.optim is not None:
            out.update({k: v for k, v in sh.optim.state.items() if k != "step"})
            if "step" in sh.optim.state:   # element-wise, as every fragment is
                out[ROW_STEP] = sh.optim.state["step"].unsqueeze(1).expand(-1, self.space.dim).contiguous()
        return out

    def add_pieces(self, pieces: Pieces) -> None:
        """The shard of every table, added to the server's part."""
        pieces.fragments += shard_fragments(self.space, self.state.index, self.table_names, self._tensors(),
                                            self._table_scalars())
        for name, rows in zip(self.table_names, self.space.rows):
            pieces.params[name] = (rows, self.space.dim)

    def load_base(self, ckpt: Checkpoint) -> None:
        """A fine-tune from a base model's checkpoint: this server's rows of its tables, their optimizer state
        fresh."""
        with torch.no_grad():
            for f in shard_fragments(self.space, self.state.index, self.table_names, {PARAM: self.held.rows}, {}):
                ckpt.fill(f)

    def restore(self, ckpt: Checkpoint) -> None:
        """This server's rows and their optimizer state (each state the checkpoint holds for the tables; lazy
        AdamW's steps from the dense step without it), after the dense range was restored; tables only, the
        rounds applied: the checkpoint's step (one round a step)."""
        if self.tables_only:
            self.rounds = ckpt.step
        tensors = self._tensors()
        frags = shard_fragments(self.space, self.state.index, self.table_names, tensors, {})
        with torch.no_grad():
            for f in frags:
                for key in list(f.tensors):
                    if not ckpt.has(f.name, key):
                        del f.tensors[key]
                ckpt.fill(f)
        optim = self.held.optim
        steps = optim.state.get("step") if optim is not None else None
        if steps is not None:
            if all(ckpt.has(f.name, ROW_STEP) for f in frags):
                steps.copy_(tensors[ROW_STEP][:, 0])
            else:   # a dense AdamW's step moved every row
                steps.fill_(int(ckpt.scalars(self.table_names[0]).get("step", 0)))
