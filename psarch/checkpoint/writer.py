"""Write a checkpoint: every rank its own fragments, in parallel; rank 0 indexes them and renames the folder.

Atomic by rename: the ranks write under `.tmp_step_000K/`; after a barrier rank 0 merges the ranks' indices
into metadata.json and renames the folder to `step_000K/`, so a crash or kill mid-write leaves only an
unfinished temporary folder, never a checkpoint that looks complete (reader.latest_complete skips it)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from psarch.checkpoint import rng
from psarch.checkpoint.fragments import PARAM, Pieces
from psarch.dist import DistContext

FORMAT, VERSION = "psarch-checkpoint", 1
METADATA = "metadata.json"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """The `step_*` folders under `root` with their metadata written, oldest step first (by number: a name
    sort would put step_1000000 before step_999999)."""
    done = [p for p in Path(root).glob("step_*") if p.name[5:].isdigit() and (p / METADATA).is_file()]
    return sorted(done, key=lambda p: int(p.name[5:]))


def save(pieces: Pieces, ctx: DistContext, root: Path, step: int, config: dict[str, Any], keep: int = 0,
         rows: list[dict[str, Any]] | None = None) -> Path:
    """Write this rank's `pieces` (the fragments it must write) and its metric `rows` so far into checkpoint
    `step` under `root`; a collective call: every rank makes it. Rank 0 keeps the newest `keep` (0: all)."""
    final, tmp = step_dir(root, step), root / f".tmp_step_{step:06d}"
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier attempt's leftovers
        tmp.mkdir(parents=True)
    _barrier(ctx)
    _write_rank(pieces, tmp, ctx.rank, rng.capture(ctx.device))
    # the rows a resumed run starts its metrics with, so none is lost or repeated
    (tmp / f"rows{ctx.rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows or []))
    _barrier(ctx)
    if ctx.rank == 0:
        _merge(tmp, ctx.world_size, step, config, pieces)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep > 0:
            for old in complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(ctx)  # no rank reports the checkpoint written before it is
    return final


def _barrier(ctx: DistContext) -> None:
    if ctx.distributed and ctx.world_size > 1:
        dist.barrier(group=ctx.group)


def _write_rank(pieces: Pieces, folder: Path, rank: int, generators: dict[str, str]) -> None:
    """rank{r}.bin: the fragments' tensors back to back, raw; rank{r}.json: where each lies, size, sha256,
    and the rank's generator states."""
    name = f"rank{rank}.bin"
    digest, pos, entries = hashlib.sha256(), 0, []
    with open(folder / name, "wb") as f:
        for frag in pieces.fragments:
            for key, t in frag.tensors.items():
                data = t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
                f.write(data)
                digest.update(data)
                entries.append({"name": frag.name, "key": key, "offset": frag.offset, "numel": t.numel(),
                                "dtype": str(t.dtype).removeprefix("torch."), "file": name, "byte_offset": pos})
                pos += len(data)
        f.flush()
        os.fsync(f.fileno())
    scalars = {frag.name: frag.scalars for frag in pieces.fragments}
    (folder / f"rank{rank}.json").write_text(json.dumps(
        {"file": name, "bytes": pos, "sha256": digest.hexdigest(), "entries": entries, "scalars": scalars,
         "rng": generators}))


def _merge(folder: Path, world_size: int, step: int, config: dict[str, Any], pieces: Pieces) -> None:
    """metadata.json from the ranks' indices, after checking every parameter is covered exactly once."""
    files, entries, scalars, generators = {}, [], {}, {}
    for r in range(world_size):
        part = json.loads((folder / f"rank{r}.json").read_text())
        files[part["file"]] = {"bytes": part["bytes"], "sha256": part["sha256"]}
        generators[str(r)] = part["rng"]
        entries += part["entries"]
        scalars.update(part["scalars"])
    dtypes = {e["name"]: e["dtype"] for e in entries if e["key"] == PARAM}
    params = {name: {"shape": list(shape), "numel": int(torch.Size(shape).numel()), "dtype": dtypes.get(name),
                     "scalars": scalars.get(name, {})} for name, shape in pieces.params.items()}
    covered: dict[str, int] = {}
    keys: set[str] = set()
    for e in entries:
        keys.add(e["key"])
        if e["key"] == PARAM:
            covered[e["name"]] = covered.get(e["name"], 0) + e["numel"]
    for name, p in params.items():
        if covered.get(name) != p["numel"]:  # a backend's fragments overlap or leave a gap: its bug, say so
            raise RuntimeError(f"checkpoint step {step}: parameter {name!r} has {covered.get(name, 0)} of "
                               f"{p['numel']} elements written")
    meta = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
            "state_keys": sorted(keys - {PARAM}), "params": params, "files": files, "state": pieces.state,
            "rng": generators, "config": config, "fragments": entries}
    with open(folder / METADATA, "w") as f:
        f.write(json.dumps(meta, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for r in range(world_size):
        (folder / f"rank{r}.json").unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
