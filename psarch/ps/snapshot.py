"""Checkpoints of a parameter-server run, in psarch.checkpoint's format: every server writes its range, every
worker what it holds, in parallel.

The servers share no process group with the workers, so the `save` op is the barrier. After step K:
 1. every worker writes its part (rankR.bin/.json, its rows) into `<run>/checkpoints/.tmp_step_K`, then sends
    `save` (step K, that folder) to every server and waits for the ack;
 2. a server acks no save until every live worker has asked for step K, having pushed exactly the K steps
    (GEO: K // k_steps deltas) that precede it; each of them waits, so nothing changes the server meanwhile.
    It writes serverI.bin/.json, then acks all; a save naming any other folder is refused, and a server started
    without a run folder (`psarch server`) writes none;
 3. rank 0, acked by every server, knows every part is on disk: it merges metadata.json and renames the folder.

A server's part: its fp32 range and optimizer state by parameter name and offset (any backend can fork from
it), DC-ASGD's per-worker backups (keys "dc_backup/W"), and a JSON record: version, the version last sent to
each worker, each worker's pushes (SSP's clocks), staleness histogram, skipped updates, loss scaler. GEO's
round accumulator is not saved: at a checkpoint every round is complete and the next push overwrites it.
A worker's part: the model it computes its next gradient on ("workerR/param"; GEO: its fp32 master, local
optimizer state and last synced model), and a record: pushes, the versions each server last sent it, loss scale.
With row tables (backend.embeddings = "rows") servers add their shard of every table and workers (GEO) their
row cache: psarch/ps/row_snapshot.py.

Restoring: a checkpoint of a PS run of the same shape (`run_shape`) restores every server and worker record
exactly; any other (another backend, world size, server count, mode) is a fork: the servers take the
parameters and optimizer state, every worker starts from them at step K as if it had just pulled.
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from psarch.checkpoint import rng
from psarch.checkpoint.fragments import PARAM, Fragment, Pieces, fragments_in, load_scaler, restore, restore_optimizer
from psarch.checkpoint.writer import merge, part_state, publish, step_dir, tmp_dir, write_part, write_steps
from psarch.config import Config
from psarch.ps import wire
from psarch.ps.errors import PSError

Layout = list[tuple[str, torch.Size, int]]


def run_shape(cfg: Config) -> dict[str, Any]:
    """What a PS checkpoint's records depend on: a run of the same shape restores them exactly."""
    b, geo = cfg.backend, cfg.backend.mode == "geo"
    return {"mode": b.mode, "world_size": b.world_size, "servers": b.servers, "precision": cfg.train.precision,
            "k_steps": b.k_steps if geo else None, "geo_barrier": b.geo_barrier if geo else None,
            "compensation": b.staleness_compensation if b.mode in ("async", "ssp") else None}


def exact_records(ckpt: Any, cfg: Config) -> dict[str, Any] | None:
    """The checkpoint's PS records when it was written by a PS run of this config's shape, else None (a fork)."""
    ps = ckpt.state.get("ps")
    return ps if ps is not None and ps["run"] == run_shape(cfg) else None


def pushes_by(cfg: Config, step: int) -> int:
    """How many pushes each worker has made after `step` steps (GEO pushes once per k_steps)."""
    return step // cfg.backend.k_steps if cfg.backend.mode == "geo" else step


def views(layout: Layout, tensors: dict[str, torch.Tensor], lo: int, hi: int) -> list[Fragment]:
    """Fragments of flat tensors that hold elements [lo, hi) of the flat parameter vector (one key each)."""
    flat = {k: t.detach().view(-1) for k, t in tensors.items()}
    out = []
    for name, shape, start in layout:
        a, b = max(lo, start), min(hi, start + shape.numel())
        if a < b:
            out.append(Fragment(name, tuple(shape), a - start, {k: t[a - lo:b - lo] for k, t in flat.items()}))
    return out


def shapes(layout: Layout) -> dict[str, tuple[int, ...]]:
    return {name: tuple(shape) for name, shape, _ in layout}


class ServerSnapshots:
    """Mixed into ParameterServer: the `save` op, and restoring a server from a checkpoint at start-up."""

    def _init_snapshots(self, checkpoints: Path | None) -> None:
        self.checkpoints = Path(checkpoints).resolve() if checkpoints is not None else None
        self.saves: list[tuple[bytes, int]] = []   # waiting save requests: (identity, worker)
        self.save_step, self.save_since = 0, 0.0
        self.layout: Layout | None = None

    def _layout(self) -> Layout:
        if self.layout is None:
            from psarch.ps.layout import param_layout
            self.layout = param_layout(self.cfg)
        return self.layout

    def _on_save(self, ident: bytes, msg: wire.Message) -> None:
        w, step = self._worker(msg), msg.header["step"]
        if self.checkpoints is None:
            raise PSError("save: this server was started without a run folder, so it writes no checkpoints")
        if self.state is None:
            raise PSError("save before init: no parameters yet")
        folder = tmp_dir(self.checkpoints, step)
        try:
            asked = Path(msg.header["path"]).resolve()
        except (ValueError, OSError, RuntimeError):   # a NUL byte, a symlink loop: no folder of this run
            asked = None
        if asked != folder:
            raise PSError(f"save: path {msg.header['path']!r:.200} is not this run's folder for step {step} ({folder})")
        if self.saves and step != self.save_step:
            raise PSError(f"save: worker {w} asks for step {step}, other workers for step {self.save_step}")
        if any(v == w for _, v in self.saves):
            raise PSError(f"save: worker {w} already asked for step {step}")
        if self.clock[w] != pushes_by(self.cfg, step):
            raise PSError(f"save: worker {w} has pushed {self.clock[w]} time(s); a checkpoint at step {step} "
                          f"follows {pushes_by(self.cfg, step)}")
        if not self.saves:
            self.save_step, self.save_since = step, time.monotonic()
        self.saves.append((ident, w))
        self._save_if_all()
        # still waiting: answered once every worker has asked (or with an error), not by handle()
        self.current_answered |= any(i == ident for i, _ in self.saves)

    def _save_if_all(self) -> None:
        """Write this server's part once every live worker waits in `save`, then ack them all."""
        if not self.saves or not self._live() <= {w for _, w in self.saves}:
            return   # (a worker lost while it waited still counts as asked: its part is written)
        waiting, self.saves = self.saves, []
        folder = tmp_dir(self.checkpoints, self.save_step)
        try:
            write_part(self._pieces(), folder, f"server{self.index}")
        except OSError as e:
            for ident, _ in waiting:
                self._error(ident, "save", f"save: cannot write {folder}: {e}")
            return
        for ident, _ in waiting:
            self._send(ident, "save", {"op": "ack", "version": self.state.version})

    def _save_heard(self, worker: Any) -> None:
        """A request from a worker a waiting save still needs: it is on its way to the save's step (without a
        barrier it may be many steps behind), so the wait counts from now."""
        if self.saves and worker not in {w for _, w in self.saves}:
            self.save_since = time.monotonic()

    def _save_overdue(self, now: float) -> bool:
        """Fail the server when a save has heard nothing from the workers it waits for in silence_s (timeout_s,
        GEO: x k_steps, as their silence between pushes may last)."""
        if not self.saves or now - self.save_since <= self.silence_s:
            return False
        missing = sorted(self._live() - {w for _, w in self.saves})
        text = (f"checkpoint step {self.save_step}: no word from worker(s) {missing} within {self.silence_s:g} s "
                f"(backend.timeout_s" + (" x backend.k_steps)" if self.mode == "geo" else ")"))
        waiting, self.saves = self.saves, []
        for ident, _ in waiting:
            self._error(ident, "save", text)
        self._fail(text)
        return True

    def _pieces(self) -> Pieces:
        st, layout, lo, hi = self.state, self._layout(), self.lo, self.hi
        if st.optim is not None:
            fragments = fragments_in(st.optim.optimizer, st.optim.master.params, 0, layout, lo, hi)
        else:   # GEO: parameters only, no server optimizer
            fragments = views(layout, {PARAM: st.params}, lo, hi)
        if st.backup is not None:
            fragments += views(layout, {f"dc_backup/{w}": b for w, b in enumerate(st.backup)}, lo, hi)
        record = {"server": self.index, "range": [lo, hi], "version": st.version,
                  "sent_version": list(st.sent_version), "clock": list(self.clock),
                  "staleness": {str(k): v for k, v in sorted(st.staleness.items())}, "skipped": st.skipped,
                  "max_ahead": self.max_ahead}
        if st.optim is not None and st.optim.scaler.enabled:
            record["scaler"] = st.optim.scaler.state_dict()
        return Pieces(fragments, shapes(layout), record)

    def restore(self, ckpt: Any) -> None:
        """Start from a checkpoint: its parameters and optimizer state for this range; the server's records
        exactly when a PS run of this shape wrote it, else those of a run whose workers all just pulled."""
        st, layout, lo, hi, n = self.state, self._layout(), self.lo, self.hi, self.workers
        if st.optim is not None:
            restore_optimizer(st.optim, ckpt, lambda: fragments_in(st.optim.optimizer, st.optim.master.params, 0,
                                                                   layout, lo, hi))
        else:
            with torch.no_grad():
                for f in views(layout, {PARAM: st.params}, lo, hi):
                    ckpt.fill(f)
        ps = exact_records(ckpt, self.cfg)
        if ps is None:
            pushes = pushes_by(self.cfg, ckpt.step)
            # version counts updates: one per round with a barrier, one per push without (N per step)
            version = pushes if self.barrier else pushes * n
            st.version, st.sent_version, self.clock = version, [version] * n, [pushes] * n
            for b in st.backup or []:
                b.copy_(st.params.detach())   # DC: each worker's backup is the model it pulls
            return
        rec = ps["servers"][self.index]
        st.version, st.sent_version, self.clock = rec["version"], list(rec["sent_version"]), list(rec["clock"])
        st.staleness = Counter({int(k): v for k, v in rec["staleness"].items()})
        st.skipped, self.max_ahead = rec["skipped"], rec["max_ahead"]
        if "scaler" in rec:
            st.optim.scaler.load_state_dict(rec["scaler"])
        if st.backup is not None:
            with torch.no_grad():
                for f in views(layout, {f"dc_backup/{w}": b for w, b in enumerate(st.backup)}, lo, hi):
                    ckpt.fill(f)


# ---------------------------------------------------------------------------------------------- workers


def worker_pieces(tr: Any) -> Pieces:
    """A PS worker's part: the model it computes on next (GEO: its local training state) and its record."""
    own = f"worker{tr.ctx.rank}/"
    record: dict[str, Any] = {"rank": tr.ctx.rank, "steps": tr.steps, "rounds": tr.rounds,
                              "versions": list(tr.versions), "loss_scale": tr.loss_scale}
    if tr.local is None:
        tensors = {own + "param": tr.flat.data}
    else:
        master = tr.local.master.params[0]
        state = tr.local.optimizer.state.get(master, {})
        tensors = {own + "master": master, own + "synced": tr.synced,
                   **{own + k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}}
        record.update(local_keys=[k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0],
                      local_scalars={k: float(v) for k, v in state.items() if not torch.is_tensor(v) or v.dim() == 0},
                      scaler=tr.local.scaler.state_dict())
    return Pieces(views(tr.layout, tensors, 0, tr.flat.numel), tr.param_shapes, record)


def save_worker(tr: Any, root: Path, step: int, config: dict[str, Any], keep: int,
                rows: list[dict[str, Any]] | None) -> Path:
    """Write checkpoint `step` from a PS worker (every worker calls it after the same step; see above)."""
    from psarch.ps.client import Request

    rank, tmp = tr.ctx.rank, tmp_dir(Path(root), step)
    tmp.mkdir(parents=True, exist_ok=True)
    pieces = tr.checkpoint_pieces()
    write_part(pieces, tmp, f"rank{rank}", rng.capture(tr.ctx.device))   # dropout's stream goes on
    write_steps(tmp, rank, rows)
    tr.client.exchange([[Request({"op": "save", "step": step, "path": str(tmp)})] for _ in tr.ranges])
    final = step_dir(Path(root), step)
    if rank == 0:
        # every live worker wrote its part before its save; a lost worker's part is missing
        workers = [f"rank{r}" for r in range(tr.n) if (tmp / f"rank{r}.json").is_file()]
        servers = [f"server{i}" for i in range(len(tr.ranges))]
        records = {p: part_state(tmp, p) for p in workers + servers}
        scaler = next((records[p]["scaler"] for p in servers + workers if "scaler" in records[p]), None)
        state = {"ps": {"run": run_shape(tr.cfg), "servers": [records[p] for p in servers],
                        "workers": [records[p] for p in workers]}, **({"scaler": scaler} if scaler else {})}
        merge(tmp, workers + servers, step, config, pieces.params, state)
        publish(tmp, final, keep)
    return final


def restore_worker(tr: Any, ckpt: Any) -> None:
    """Continue a PS worker from a checkpoint (the servers restored themselves when they started)."""
    ps, rank, own = exact_records(ckpt, tr.cfg), tr.ctx.rank, f"worker{tr.ctx.rank}/"
    tr.steps = ckpt.step
    recs = {r["rank"]: r for r in ps["workers"]} if ps is not None else {}
    if rank not in recs:   # a fork: start from the servers' parameters, as if just pulled
        tr.rounds = pushes_by(tr.cfg, ckpt.step) if tr.local is not None else 0
        tr._pull_only(pushes_by(tr.cfg, ckpt.step))
        if tr.local is not None:   # GEO: every worker's local optimizer starts from the checkpoint's state
            master = tr.local.master.params[0]
            restore(tr.local.optimizer, [master], ckpt,
                    lambda: fragments_in(tr.local.optimizer, [master], 0, tr.layout, 0, tr.flat.numel))
            load_scaler(tr.local.scaler, ckpt)
            tr.local.master.copy_to_model()
            tr.synced.copy_(master.detach())
        return
    rec = recs[rank]
    tr.rounds, tr.versions, tr.loss_scale = rec["rounds"], list(rec["versions"]), rec["loss_scale"]
    if tr.local is None:
        tensors = {own + "param": tr.flat.data}
    else:
        master = tr.local.master.params[0]
        state = tr.local.optimizer.state[master]
        state.clear()
        for k in rec["local_keys"]:
            state[k] = torch.zeros_like(master, memory_format=torch.contiguous_format)
        group = tr.local.optimizer.param_groups[0]   # where torch keeps a step count, as restore() does
        device = master.device if group.get("fused") or group.get("capturable") else "cpu"
        for k, v in rec["local_scalars"].items():
            state[k] = torch.tensor(v, dtype=torch.float32, device=device)
        tensors = {own + "master": master, own + "synced": tr.synced, **{own + k: state[k] for k in rec["local_keys"]}}
        tr.local.scaler.load_state_dict(rec["scaler"])
    with torch.no_grad():
        for f in views(tr.layout, tensors, 0, tr.flat.numel):
            ckpt.fill(f)
    if tr.local is not None:
        tr.local.master.copy_to_model()
