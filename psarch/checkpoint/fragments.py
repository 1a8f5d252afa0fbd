"""What a trainer hands the checkpoint: its state by parameter name and flat offset, as views into live tensors.

A backend lays its fp32 master weights out as it likes (per parameter, one flat buffer, chunks of padded
groups); `fragments_in` turns one such layout into fragments, and `restore` fills them from a checkpoint,
creating the optimizer state first where the optimizer has not stepped yet (torch creates it lazily).
`ckpt` arguments are psarch.checkpoint.reader.Checkpoint (imported for type checking only: the reader imports this)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

if TYPE_CHECKING:
    from psarch.checkpoint.reader import Checkpoint

PARAM = "param"   # the key of a fragment's fp32 master value; the others are optimizer state names


def private(key: str) -> bool:
    """A key like "worker1/param" or "dc_backup/0" is a backend's own record over the parameter (a PS worker's
    model, DC-ASGD's backups), read only by that backend: not optimizer state any other backend creates."""
    return "/" in key


@dataclass
class Fragment:
    """Elements [offset, offset + numel) of the flattened parameter `name` (full shape `shape`), held here
    as 1-D views: `tensors["param"]` the fp32 master, the others optimizer state (exp_avg, ...); `scalars`
    the optimizer's per-tensor numbers (AdamW's step); `holder` the index of the master tensor holding it.
    `row_stride` > 0: rows of a 2-D parameter held with a stride (a parameter server's shard of a table, keys
    mod S): the tensors hold row offset // row_len, then every row_stride-th row after it, whole rows.
    `columns` (c0, c1): columns [c0, c1) of a 2-D parameter's rows (a row-parallel linear's shard, whose
    columns are no one flat range): the tensors hold those columns of row offset // row_len and of each row
    after it (every row_stride-th where row_stride > 0), row after row; offset % row_len is c0."""

    name: str
    shape: tuple[int, ...]
    offset: int
    tensors: dict[str, torch.Tensor]
    scalars: dict[str, float] = field(default_factory=dict)
    holder: int = 0
    row_stride: int = 0
    columns: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return self.tensors[PARAM].numel()


@dataclass
class Pieces:
    """A rank's part of a checkpoint: its fragments, every parameter of the model (name -> shape, in the
    model's order) and the JSON-able state beside them (loss scaler)."""

    fragments: list[Fragment]
    params: dict[str, tuple[int, ...]]
    state: dict[str, Any] = field(default_factory=dict)


def optimizer_views(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                                                     dict[str, float]]:
    """The optimizer's state of one master tensor: element-wise tensors as flat views, and its 0-dim numbers."""
    tensors, scalars = {}, {}
    for k, v in optimizer.state.get(master, {}).items():
        if torch.is_tensor(v) and v.dim() > 0:
            if v.numel() != master.numel() or not v.is_contiguous():
                raise ValueError(f"optimizer state {k!r}: {tuple(v.shape)} is not element-wise over {tuple(master.shape)}")
            tensors[k] = v.view(-1)
        elif torch.is_tensor(v) or isinstance(v, (int, float)):
            scalars[k] = float(v)
    return tensors, scalars


def local_views(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                                              dict[str, float]]:
    """What this rank holds of a parameter that may be a DTensor (the torch peers that shard with them): its
    local shard and the optimizer's element-wise state of it as flat views, and the optimizer's numbers."""
    def held(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if hasattr(t, "to_local") else t).detach().view(-1)

    tensors, scalars = {PARAM: held(param)}, {}
    for k, v in optimizer.state.get(param, {}).items():
        if torch.is_tensor(v) and v.dim() > 0:
            tensors[k] = held(v)
        else:
            scalars[k] = float(v)
    return tensors, scalars


def fragments_in(optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor], holder: int,
                 params: Sequence[tuple[str, torch.Size, int]], lo: int, hi: int, base: int = 0) -> list[Fragment]:
    """Fragments of parameters laid out flat in a region (`params`: name, shape, offset in the region) of
    which elements [lo, hi) are held here, region element `lo` at index `base` of masters[holder]."""
    master = masters[holder]
    state, scalars = optimizer_views(optimizer, master)
    flat = {PARAM: master.detach().view(-1), **state}
    out = []
    for name, shape, start in params:
        numel = shape.numel()
        a, b = max(lo, start), min(hi, start + numel)
        if a >= b:
            continue
        i = base + a - lo
        out.append(Fragment(name, tuple(shape), a - start, {k: t[i:i + b - a] for k, t in flat.items()},
                            dict(scalars), holder))
    return out


def master_fragments(optim: Any, i: int, params: Sequence[tuple[str, torch.Size, int]], lo: int, hi: int,
                     base: int = 0) -> list[Fragment]:
    """fragments_in for the i-th model tensor a psarch.precision.MixedPrecisionOptimizer was given: its fp32
    master is that tensor itself (fp32) or a slice of one flat fp32 buffer (bf16/fp16), which is what the
    optimizer steps on and keys its state by."""
    master = optim.master
    holder, offset = (i, 0) if not master.copies else (0, sum(t.numel() for t in master.model_tensors[:i]))
    return fragments_in(optim.optimizer, master.params, holder, params, lo, hi, base + offset)


def restore_optimizer(optim: Any, ckpt: Checkpoint, fragments_of: Callable[[], list[Fragment]]) -> None:
    """restore() for a MixedPrecisionOptimizer, then its loss scaler, then the masters into the model's dtype."""
    restore(optim.optimizer, optim.master.params, ckpt, fragments_of)
    load_scaler(optim.scaler, ckpt)
    optim.master.copy_to_model()


def whole_parameters(optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor],
                     named: Sequence[tuple[str, torch.Tensor]]) -> list[Fragment]:
    """One fragment per parameter for backends that keep a master per parameter (masters[i] of named[i])."""
    return [f for i, (name, p) in enumerate(named)
            for f in fragments_in(optimizer, masters, i, [(name, p.shape, 0)], 0, p.numel())]


def share_of(fragments: list[Fragment], rank: int, world_size: int) -> list[Fragment]:
    """For replicated state (every rank holds all of it): the fragments this rank writes, whole fragments
    dealt largest first to the least-loaded rank, so each rank writes about 1/N of the bytes."""
    load = [0] * world_size
    mine = []
    for f in sorted(fragments, key=lambda f: (-f.numel, f.name, f.offset)):
        r = load.index(min(load))
        load[r] += f.numel
        if r == rank:
            mine.append(f)
    return mine


def scaler_state(scaler: Any) -> dict[str, Any]:
    """The JSON state a checkpoint keeps beside the fragments: the loss scaler's, where one is at work (fp16)."""
    return {"scaler": scaler.state_dict()} if scaler.enabled else {}


def load_scaler(scaler: Any, ckpt: Checkpoint) -> None:
    """Take the checkpoint's loss scale where both sides scale (fp16 -> fp16); a fork into fp16 from
    another precision starts a fresh scaler."""
    if scaler.enabled and "scaler" in ckpt.state:
        scaler.load_state_dict(ckpt.state["scaler"])


def restore(optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor], ckpt: Checkpoint,
            fragments_of: Callable[[], list[Fragment]]) -> list[Fragment]:
    """Create the optimizer state the checkpoint holds (zeros, then its scalars) for every master, then fill
    every fragment `fragments_of()` lists from the checkpoint. Returns the fragments filled."""
    keys = ckpt.state_keys
    for m in masters:
        st = optimizer.state[m]
        st.clear()
        for k in keys:
            st[k] = torch.zeros_like(m, memory_format=torch.contiguous_format)
    fragments = fragments_of()
    first: dict[int, Fragment] = {}
    for f in fragments:
        first.setdefault(f.holder, f)   # holder -1: a replica of a parameter whose state another rank owns
    default = ckpt.scalars(next(iter(ckpt.params)))
    for i, m in enumerate(masters):
        scalars = ckpt.scalars(first[i].name) if i in first else default
        group = next(g for g in optimizer.param_groups if any(p is m for p in g["params"]))
        # where torch keeps a step count: on the device for fused or capturable kernels, else on the CPU
        device = m.device if group.get("fused") or group.get("capturable") else "cpu"
        for k, v in scalars.items():
            optimizer.state[m][k] = torch.tensor(v, dtype=torch.float32, device=device)
    with torch.no_grad():
        for f in fragments:
            ckpt.fill(f)
    return fragments
