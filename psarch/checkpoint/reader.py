"""Read a checkpoint: verify it against its metadata, check it fits a model, fill any rank's fragments.

The metadata is JSON and the data files raw tensors, so nothing is unpickled, whoever wrote the folder."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch

from psarch.checkpoint import rng
from psarch.checkpoint.fragments import PARAM, Fragment
from psarch.records import StepRecord
from psarch.checkpoint.writer import (FORMAT, METADATA, VERSION, FragmentEntry, ParamEntry, complete_checkpoints,
                                      steps_file)


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupted, or does not fit the model."""


# what the writer ever writes: the metadata names files and dtypes, and a folder may come from anyone
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
DATA_FILE = re.compile(r"(rank|server)\d+\.bin")   # a worker's or a parameter server's


def latest_complete(root: str | Path) -> Path | None:
    """The newest `step_*` folder under `root` (a run's checkpoints/ folder) with its metadata written, or None.
    A kill mid-write leaves only a `.tmp_step_*` folder, which is never picked."""
    done = complete_checkpoints(Path(root))
    return done[-1] if done else None


class Checkpoint:
    """One checkpoint folder, opened by its metadata.json."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            meta = json.loads((self.path / METADATA).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: no {METADATA} (not a checkpoint, or one not completely written)") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path / METADATA}: not valid JSON ({e})") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise CheckpointError(f"{self.path}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                                  f"expected {FORMAT!r} version {VERSION}")
        for name in meta["files"]:
            if not isinstance(name, str) or not DATA_FILE.fullmatch(name):
                raise CheckpointError(f"{self.path / METADATA}: data file {name!r} is not a rankN.bin or serverN.bin name")
        for frag in meta["fragments"]:
            if frag["file"] not in meta["files"]:
                raise CheckpointError(f"{self.path / METADATA}: a fragment lies in {frag['file']!r}, not a listed file")
            if frag["dtype"] not in DTYPES:
                raise CheckpointError(f"{self.path / METADATA}: dtype {frag['dtype']!r} of {frag['name']!r} is not "
                                      f"one of {sorted(DTYPES)}")
            if "row_stride" in frag or "columns" in frag:
                _check_rows(self.path / METADATA, frag, meta["params"].get(frag["name"], {}).get("shape"))
        self.meta = meta
        self.step: int = meta["step"]
        self.params: dict[str, ParamEntry] = meta["params"]
        self.state_keys: list[str] = meta["state_keys"]
        self.config: dict[str, Any] = meta["config"]
        self.state: dict[str, Any] = meta["state"]
        self._index: dict[tuple[str, str], list[FragmentEntry]] = {}
        for frag in meta["fragments"]:
            self._index.setdefault((frag["name"], frag["key"]), []).append(frag)
        for entries in self._index.values():
            entries.sort(key=lambda e: e["offset"])
        self._files: dict[str, BinaryIO] = {}

    def verify(self) -> None:
        """Every data file present, of the size and sha256 the metadata records."""
        for name, info in self.meta["files"].items():
            path = self.path / name
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (the metadata lists it)")
            size = path.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(f"{path}: {size} bytes, the metadata records {info['bytes']} (truncated?)")
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
            if digest.hexdigest() != info["sha256"]:
                raise CheckpointError(f"{path}: sha256 differs from the metadata's (corrupted)")

    def check_model(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """The model's parameters (name -> shape, in order) are the checkpoint's: else one line naming the first
        that differs."""
        for name, shape in shapes.items():
            if name not in self.params:
                raise CheckpointError(f"{self.path}: the model's parameter {name!r} is not in the checkpoint")
            if list(shape) != self.params[name]["shape"]:
                raise CheckpointError(f"{self.path}: parameter {name!r} has shape {list(shape)} in the model, "
                                      f"{self.params[name]['shape']} in the checkpoint")
        for name in self.params:
            if name not in shapes:
                raise CheckpointError(f"{self.path}: the checkpoint's parameter {name!r} is not in the model")

    def check_optimizer(self, optimizer: str) -> None:
        """The optimizer a config names is the one whose state the checkpoint holds."""
        wrote = self.config.get("train", {}).get("optimizer")
        if wrote != optimizer:
            raise CheckpointError(f"train.optimizer = {optimizer!r}: the checkpoint {self.path} holds {wrote!r} state")

    def scalars(self, name: str) -> dict[str, float]:
        """The optimizer's numbers (AdamW's step) for parameter `name`."""
        return self.params[name]["scalars"]

    def read(self, name: str, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of `key` (PARAM or an optimizer state) of the flattened parameter `name`, from
        every stored fragment that overlaps them (strided row fragments and column blocks included)."""
        out: torch.Tensor | None = None
        filled = 0
        pos: torch.Tensor | slice
        for e in self._index.get((name, key), ()):
            if e.get("row_stride") or e.get("columns"):
                got = self._block(e, self.params[name]["shape"][-1], lo, hi)
                if got is None:
                    continue
                part, pos = got
            else:
                a, b = max(lo, e["offset"]), min(hi, e["offset"] + e["numel"])
                if a >= b:
                    continue
                part, pos = self._load(e, name, key, a - e["offset"], b - a), slice(a - lo, b - lo)
            if out is None:
                out = torch.empty(hi - lo, dtype=part.dtype)
            out[pos] = part
            filled += part.numel()
        if out is None or filled != hi - lo:
            raise CheckpointError(f"{self.path}: {name!r} {key} elements [{lo}, {hi}) are not all stored")
        return out

    def _load(self, e: FragmentEntry, name: str, key: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of one stored fragment."""
        dtype = DTYPES[e["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        f = self._file(e["file"])
        f.seek(e["byte_offset"] + start * size)
        data = f.read(count * size)
        if len(data) != count * size:
            raise CheckpointError(f"{self.path / e['file']}: ends inside {name!r} {key} (truncated)")
        return torch.frombuffer(bytearray(data), dtype=dtype)

    def _block(self, e: FragmentEntry, row: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The values of a strided row fragment or a column block that lie in [lo, hi), and their positions there."""
        stride = e.get("row_stride") or 1
        c0, c1 = e.get("columns") or (0, row)
        width, first = c1 - c0, e["offset"] // row
        count = e["numel"] // width
        # the fragment's j-th row is columns [c0, c1) of the parameter's row first + j * stride
        j0 = max(0, -(-(lo // row - first) // stride))
        j1 = min(count, ((hi - 1) // row - first) // stride + 1)
        if j0 >= j1:
            return None
        block = self._load(e, e["name"], e["key"], j0 * width, (j1 - j0) * width).view(-1, width)
        pos = ((first + stride * torch.arange(j0, j1)) * row + c0).unsqueeze(1) + torch.arange(width)
        keep = (pos >= lo) & (pos < hi)
        return block[keep], pos[keep] - lo

    def numel(self, name: str, key: str) -> int:
        """Elements of `key` stored for `name`, from offset 0 on (0 where none is)."""
        return max((e["offset"] + e["numel"] for e in self._index.get((name, key), ())), default=0)

    def has(self, name: str, key: str) -> bool:
        """Whether any fragment of `key` (PARAM, an optimizer state, a private record) of `name` is stored."""
        return (name, key) in self._index

    def fill(self, fragment: Fragment) -> None:
        """Copy the checkpoint's values into every tensor of a fragment a rank holds."""
        for key, t in fragment.tensors.items():
            if not fragment.row_stride and not fragment.columns:
                t.copy_(self.read(fragment.name, key, fragment.offset, fragment.offset + t.numel()))
            elif t.numel():   # the span from its first row to its last, one parameter at a time
                row, stride = fragment.shape[-1], fragment.row_stride or 1
                c0, c1 = fragment.columns or (0, row)
                start = fragment.offset - c0
                end = start + ((t.numel() // (c1 - c0) - 1) * stride + 1) * row
                t.copy_(self.read(fragment.name, key, start, end).view(-1, row)[::stride, c0:c1].reshape(-1))

    def restore_rng(self, rank: int, device: torch.device) -> bool:
        """Set this process's generators to rank `rank`'s at the checkpoint; False where it holds none for that
        rank (a fork onto more ranks: those keep their seeded start)."""
        state = self.meta.get("rng", {}).get(str(rank))
        if state is None:
            return False
        try:
            rng.restore(state, device)
        except ValueError as e:
            raise CheckpointError(f"{self.path / METADATA}: rank {rank}'s {e}") from None
        return True

    def steps(self, rank: int) -> list[StepRecord]:
        """Rank `rank`'s step records of the steps before this checkpoint ([] if it wrote none); a checkpoint
        written before they were called so holds them in rows<R>.jsonl."""
        path = steps_file(self.path, rank)
        path = path if path.is_file() else self.path / f"rows{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _file(self, name: str) -> BinaryIO:
        if name not in self._files:
            self._files[name] = open(self.path / name, "rb")
        return self._files[name]


def _check_rows(where: Path, e: FragmentEntry, shape: list[int] | None) -> None:
    """A strided row fragment or a column block must hold whole rows (or the same columns of each row) of a 2-D
    parameter, with a positive integer stride and columns 0 <= c0 < c1 <= the row's length."""
    stride = e.get("row_stride", 1)
    if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
        raise CheckpointError(f"{where}: row_stride {stride!r} of {e['name']!r} is not a positive integer")
    if not shape or len(shape) != 2:
        raise CheckpointError(f"{where}: a strided fragment or column block of {e['name']!r} (shape {shape}) "
                              f"is not of a 2-D parameter")
    cols = e.get("columns", [0, shape[1]])
    if not (isinstance(cols, list) and len(cols) == 2 and all(isinstance(c, int) and not isinstance(c, bool)
                                                              for c in cols) and 0 <= cols[0] < cols[1] <= shape[1]):
        raise CheckpointError(f"{where}: columns {cols!r} of {e['name']!r} are not [c0, c1] with "
                              f"0 <= c0 < c1 <= {shape[1]}")
    if e["offset"] % shape[1] != cols[0] or e["numel"] % (cols[1] - cols[0]):
        raise CheckpointError(f"{where}: a fragment of {e['name']!r} (shape {shape}) at offset {e['offset']}, "
                              f"{e['numel']} elements, is not whole rows of a 2-D parameter"
                              + (f" (columns {cols} of each)" if "columns" in e else ""))


def consolidated_state_dict(path: str | Path, verify: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's fp32 parameters as (name, tensor) pairs in the model's order, read one parameter at a
    time: `dict(consolidated_state_dict(p))` is a plain state_dict a model loads (parameters only)."""
    ckpt = Checkpoint(path)
    if verify:
        ckpt.verify()
    try:
        for name, p in ckpt.params.items():
            yield name, ckpt.read(name, PARAM, 0, p["numel"]).reshape(p["shape"])
    finally:
        ckpt.close()
