"""A server's side of checkpoints (the protocol and the format: psarch/ps/snapshot.py): the `save` op, the
barrier it is, and restoring a server from a checkpoint at start-up."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import PARAM, Pieces, fragments_in, restore_optimizer
from psarch.checkpoint.writer import tmp_dir, write_part
from psarch.ps.layout import Layout
from psarch.ps import wire
from psarch.ps.errors import PSError
from psarch.ps.layout import param_layout
from psarch.ps.server.deltas import WorkerCopies
from psarch.ps.server.replies import Replies
from psarch.ps.server.state import ServerState
from psarch.ps.snapshot import PartitionRecord, ServerRecord, exact_records, pushes_by, shapes, views

if TYPE_CHECKING:
    from psarch.ps.server.rows import ServerRows


class Snapshots:
    """The `save` requests waiting for every live worker, and what this server writes and restores."""

    def __init__(self, state: ServerState, replies: Replies, checkpoints: Path | None,
                 rows: ServerRows | None) -> None:
        """checkpoints: the run's checkpoint folder, the only place a `save` may write (None: no saves)."""
        self.state, self.replies, self.rows = state, replies, rows
        self.checkpoints = Path(checkpoints).resolve() if checkpoints is not None else None
        # waiting save requests: (identity, worker); a worker may ask twice (the same save: both are answered)
        self.saves: list[tuple[bytes, int]] = []
        self.step, self.since = 0, 0.0            # the step they ask for, and since when they wait
        self.written = -1                         # the step of the last part written (asked again: done)
        self._layout: Layout | None = None

    @property
    def layout(self) -> Layout:
        """The dense parameters' layout in the flat vector (built once, on the meta device)."""
        if self._layout is None:
            self._layout = self.rows.dense_layout() if self.rows is not None else param_layout(self.state.cfg)
        return self._layout

    def on_save(self, ident: bytes, msg: wire.Message) -> None:
        s = self.state
        w, step = s.sender(msg), msg.header["step"]
        if self.checkpoints is None:
            raise PSError("save: this server was started without a run folder, so it writes no checkpoints")
        tables = self.rows is not None and self.rows.tables_only   # the hybrid's server: rows, no dense range
        if not s.initialised and not tables:
            raise PSError("save before init: no parameters yet")
        folder = tmp_dir(self.checkpoints, step)
        try:
            asked = Path(msg.header["path"]).resolve()
        except (ValueError, OSError, RuntimeError):   # a NUL byte, a symlink loop: no folder of this run
            asked = None
        if asked != folder:
            raise PSError(f"save: path {msg.header['path']!r:.200} is not this run's folder for step {step} ({folder})")
        every = s.cfg.train.checkpoint_every
        if not every or step <= 0 or step % every:
            raise PSError(f"save: step {step} is not a checkpoint step of this run (train.checkpoint_every = {every})")
        if self.saves and step != self.step:
            raise PSError(f"save: worker {w} asks for step {step}, other workers for step {self.step}")
        clocks = {p.clock[w] for p in s.parts}
        if tables and self.rows is not None:
            self.rows.check_save(w, step)
        elif clocks != {pushes_by(s.cfg, step)}:
            raise PSError(f"save: worker {w} has pushed {'/'.join(map(str, sorted(clocks)))} time(s) (by partition); "
                          f"a checkpoint at step {step} follows {pushes_by(s.cfg, step)}")
        if step == self.written:   # a worker's second ask (its key on two connections): the part is written
            return self.replies.send(ident, "save", {"op": "ack", "version": s.version})
        if not self.saves:
            self.step, self.since = step, time.monotonic()
        self.saves.append((ident, w))
        self.save_if_all()
        # still waiting: answered once every worker has asked (or with an error), not by handle()
        s.current_answered |= any(i == ident for i, _ in self.saves)

    def save_if_all(self) -> None:
        """Write this server's part once every live worker waits in `save`, then ack them all."""
        if not self.saves or not self.state.live <= {w for _, w in self.saves}:
            return   # (a worker lost while it waited still counts as asked: its part is written)
        assert self.checkpoints is not None   # on_save refuses every save without a run folder
        waiting, self.saves = self.saves, []
        folder = tmp_dir(self.checkpoints, self.step)
        try:
            write_part(self.pieces(), folder, f"server{self.state.index}")
        except OSError as e:
            for ident, _ in waiting:
                self.replies.error(ident, "save", f"save: cannot write {folder}: {e}")
            return
        self.written = self.step
        for ident, _ in waiting:
            self.replies.send(ident, "save", {"op": "ack", "version": self.state.version})

    def heard(self, worker: Any) -> None:
        """A request from a worker a waiting save still needs: it is on its way to the save's step (without a
        barrier it may be many steps behind), so the wait counts from now."""
        if self.saves and worker not in {w for _, w in self.saves}:
            self.since = time.monotonic()

    def overdue(self, now: float) -> bool:
        """Fail the server when a save has heard nothing from the workers it waits for in silence_s (timeout_s,
        GEO: x k_steps, as their silence between pushes may last)."""
        s = self.state
        if not self.saves or now - self.since <= s.silence_s:
            return False
        missing = sorted(s.live - {w for _, w in self.saves})
        text = (f"checkpoint step {self.step}: no word from worker(s) {missing} within {s.silence_s:g} s "
                f"({s.silence_text})")
        waiting, self.saves = self.saves, []
        for ident, _ in waiting:
            self.replies.error(ident, "save", text)
        self.replies.fail(text)
        return True

    def pieces(self) -> Pieces:
        """This server's part: each partition's range (with optimizer state, DC backups) and record; its rows' shard."""
        s = self.state
        if self.rows is not None and self.rows.tables_only:   # the hybrid's server: its rows' shard and rounds
            pieces = Pieces([], {}, {"server": s.index, "rounds": self.rows.rounds})
            self.rows.add_pieces(pieces)
            return pieces
        layout = self.layout
        fragments: list = []
        records: list[PartitionRecord] = []
        for part in s.parts:
            st, lo, hi = part.range, part.lo, part.hi
            if st.optim is not None:
                fragments += fragments_in(st.optim.optimizer, st.optim.master.params, 0, layout, lo, hi)
            else:   # GEO: parameters only, no server optimizer
                fragments += views(layout, {PARAM: st.params}, lo, hi)
            if st.backup is not None:
                fragments += views(layout, {f"dc_backup/{w}": b for w, b in enumerate(st.backup)}, lo, hi)
            if st.copies is not None:
                fragments += views(layout, _copies(st.copies), lo, hi)
            rec: PartitionRecord = {"range": [lo, hi], "version": st.version, "sent_version": list(st.sent_version),
                   "clock": list(part.clock), "staleness": {str(k): v for k, v in sorted(st.staleness.items())},
                   "skipped": st.skipped}
            if st.optim is not None and st.optim.scaler.enabled:
                rec["scaler"] = st.optim.scaler.state_dict()
            if st.copies is not None:
                rec["copies_moved"] = st.copies.moved
            records.append(rec)
        record: ServerRecord = {"server": s.index, "held": s.size, "max_ahead": s.max_ahead, "partitions": records}
        if "scaler" in records[0]:   # what a fork onto another backend takes (every partition's is alike in sync)
            record["scaler"] = records[0]["scaler"]
        pieces = Pieces(fragments, shapes(layout), dict(record))   # the part's JSON state
        if self.rows is not None:
            self.rows.add_pieces(pieces)
        return pieces

    def restore(self, ckpt: Checkpoint) -> None:
        """Start from a checkpoint: its parameters and optimizer state for this range (and rows); the server's
        records exactly when a PS run of this shape wrote it, else those of a run whose workers all just pulled.
        The hybrid's server (tables only): its rows and their optimizer state, `step` rounds applied."""
        if self.rows is not None and self.rows.tables_only:
            self.rows.restore(ckpt)
            return
        self._restore_range(ckpt)
        ps = exact_records(ckpt, self.state.cfg, self.state.numel)
        if ps is None:
            self._fork(ckpt.step)
        else:
            self._restore_records(ps["servers"][self.state.index], ckpt)
        if self.rows is not None:
            self.rows.restore(ckpt)

    def _restore_range(self, ckpt: Checkpoint) -> None:
        layout = self.layout
        for part in self.state.parts:
            st, lo, hi = part.range, part.lo, part.hi
            optim = st.optim
            if optim is not None:
                restore_optimizer(optim, ckpt, lambda: fragments_in(optim.optimizer, optim.master.params,
                                                                    0, layout, lo, hi))
            else:
                with torch.no_grad():
                    for f in views(layout, {PARAM: st.params}, lo, hi):
                        ckpt.fill(f)

    def _fork(self, step: int) -> None:
        s = self.state
        n, pushes = s.workers, pushes_by(s.cfg, step)
        # version counts updates: one per round with a barrier, one per push without (N per step)
        version = pushes if s.barrier else pushes * n
        for part in s.parts:
            st = part.range
            st.version, st.sent_version, part.clock = version, [version] * n, [pushes] * n
            for b in st.backup or []:
                b.copy_(st.params.detach())   # DC: each worker's backup is the model it pulls

    def _restore_records(self, rec: ServerRecord, ckpt: Checkpoint) -> None:
        s = self.state
        s.max_ahead = rec["max_ahead"]
        for part, r in zip(s.parts, rec["partitions"]):
            st = part.range
            st.version, st.sent_version, part.clock = r["version"], list(r["sent_version"]), list(r["clock"])
            st.staleness = Counter({int(k): v for k, v in r["staleness"].items()})
            st.skipped = r["skipped"]
            if "scaler" in r:
                assert st.optim is not None   # only a range with an optimizer records a loss scaler
                st.optim.scaler.load_state_dict(r["scaler"])
            if st.backup is not None:
                with torch.no_grad():
                    for f in views(self.layout, {f"dc_backup/{w}": b for w, b in enumerate(st.backup)},
                                   part.lo, part.hi):
                        ckpt.fill(f)
            if st.copies is not None:   # exactly what each worker holds, and whether a whole pull may still set it
                with torch.no_grad():
                    for f in views(self.layout, _copies(st.copies), part.lo, part.hi):
                        ckpt.fill(f)
                st.copies.moved = r["copies_moved"]


def _copies(copies: WorkerCopies) -> dict[str, torch.Tensor]:
    """GEO's copies of what the workers hold of a partition, by checkpoint key (one per worker; the barrier's one)."""
    return {f"geo_copy/{i}": c for i, c in enumerate(copies.copies)}
