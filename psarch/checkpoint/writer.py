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
from typing import Any, Callable, TypedDict

import torch
import torch.distributed as dist

from psarch.checkpoint import rng
from psarch.checkpoint.fragments import PARAM, Pieces, private
from psarch.dist import DistContext
from psarch.records import StepRecord

FORMAT, VERSION = "psarch-checkpoint", 1
METADATA = "metadata.json"


class _FragmentLayout(TypedDict, total=False):
    row_stride: int              # Fragment.row_stride, where > 0
    columns: list[int]           # Fragment.columns [c0, c1], where set


class FragmentEntry(_FragmentLayout):
    """Where one fragment's tensor lies: a part's `entries`, metadata.json's `fragments`."""

    name: str                    # the parameter
    key: str                     # PARAM, an optimizer state or a private record
    offset: int                  # into the flattened parameter
    numel: int
    dtype: str                   # a reader.DTYPES name
    file: str                    # the part's data file
    byte_offset: int             # into that file


class ParamEntry(TypedDict):
    """metadata.json's `params`: one parameter of the model."""

    shape: list[int]
    numel: int
    dtype: str | None            # its PARAM fragments' (None where none holds it)
    scalars: dict[str, float]    # the optimizer's numbers (AdamW's step)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def tmp_dir(root: Path, step: int) -> Path:
    """Where checkpoint `step` is written before its rename to step_dir: never picked by a reader."""
    return root / f".tmp_step_{step:06d}"


def steps_file(folder: Path, rank: int) -> Path:
    """A rank's step records of the steps before the checkpoint, in the checkpoint's folder."""
    return folder / f"steps{rank}.jsonl"


def checkpoint_step(folder: Path) -> int:
    """The step a checkpoint folder (step_000040) was written at."""
    return int(Path(folder).name[5:])


def complete_checkpoints(root: Path) -> list[Path]:
    """The `step_*` folders under `root` with their metadata written, oldest step first (by number: a name
    sort would put step_1000000 before step_999999)."""
    done = [p for p in Path(root).glob("step_*") if p.name[5:].isdigit() and (p / METADATA).is_file()]
    return sorted(done, key=checkpoint_step)


def save(pieces: Pieces, ctx: DistContext, root: Path, step: int, config: dict[str, Any], keep: int = 0,
         steps: list[StepRecord] | None = None, services: Callable[[int, Path], list[str]] | None = None) -> Path:
    """Write this rank's `pieces` (the fragments it must write) and its step records so far into checkpoint
    `step` under `root`; a collective call: every rank makes it. Rank 0 keeps the newest `keep` (0: all).
    `services(step, folder)`: has the services beside the ranks (the hybrid's PS servers) write their parts into
    the temporary folder once this rank's is written, and names them; rank 0 merges them with the ranks' (their
    JSON states under the metadata's state `services`), so the folder is renamed only once every part is in."""
    final, tmp = step_dir(root, step), tmp_dir(root, step)
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier attempt's leftovers
        tmp.mkdir(parents=True)
    _barrier(ctx)
    write_part(pieces, tmp, f"rank{ctx.rank}", rng.capture(ctx.device))
    write_steps(tmp, ctx.rank, steps)
    others = services(step, tmp) if services is not None else []
    _barrier(ctx)
    if ctx.rank == 0:
        state = dict(pieces.state, services=[part_state(tmp, p) for p in others]) if others else pieces.state
        merge(tmp, [f"rank{r}" for r in range(ctx.world_size)] + others, step, config, pieces.params, state,
              ctx.world_size)
        publish(tmp, final, keep)
    _barrier(ctx)  # no rank reports the checkpoint written before it is
    return final


def write_steps(folder: Path, rank: int, steps: list[StepRecord] | None) -> None:
    """The step records a resumed run starts its metrics with, so none is lost or repeated."""
    steps_file(folder, rank).write_text("".join(json.dumps(r) + "\n" for r in steps or []))


def publish(tmp: Path, final: Path, keep: int) -> None:
    """Rename a merged temporary folder to its final name, then keep the newest `keep` (0: all)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if keep > 0:
        for old in complete_checkpoints(final.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _barrier(ctx: DistContext) -> None:
    if ctx.distributed and ctx.world_size > 1:
        dist.barrier(group=ctx.group)


def write_part(pieces: Pieces, folder: Path, part: str, generators: dict[str, str] | None = None) -> None:
    """{part}.bin: the fragments' tensors back to back, raw; {part}.json: where each lies, size, sha256, the
    part's own JSON state and (a rank) its generator states. `part` is rankN (a worker) or serverN (a
    parameter server)."""
    name = f"{part}.bin"
    digest, pos = hashlib.sha256(), 0
    entries: list[FragmentEntry] = []
    with open(folder / name, "wb") as f:
        for frag in pieces.fragments:
            for key, t in frag.tensors.items():
                data = t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
                f.write(data)
                digest.update(data)
                entry: FragmentEntry = {"name": frag.name, "key": key, "offset": frag.offset, "numel": t.numel(),
                                        "dtype": str(t.dtype).removeprefix("torch."), "file": name, "byte_offset": pos}
                if frag.row_stride:
                    entry["row_stride"] = frag.row_stride
                if frag.columns:
                    entry["columns"] = list(frag.columns)
                entries.append(entry)
                pos += len(data)
        f.flush()
        os.fsync(f.fileno())
    # a backend's own records (private keys) carry no optimizer numbers of the parameter
    scalars = {frag.name: frag.scalars for frag in pieces.fragments if PARAM in frag.tensors}
    (folder / f"{part}.json").write_text(json.dumps(
        {"file": name, "bytes": pos, "sha256": digest.hexdigest(), "entries": entries, "scalars": scalars,
         "state": pieces.state, **({"rng": generators} if generators is not None else {})}))


def part_state(folder: Path, part: str) -> dict[str, Any]:
    """The JSON state a part wrote beside its fragments (read before merge, which removes the part index)."""
    return json.loads((folder / f"{part}.json").read_text())["state"]


def merge(folder: Path, parts: list[str], step: int, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
          state: dict[str, Any], world_size: int) -> None:
    """metadata.json from the parts' indices, after checking every parameter is covered exactly once; files
    in the folder that no part wrote (an earlier attempt's) are removed. `world_size`: the ranks that wrote it (its
    parts may hold services' too: a PS's, the hybrid's servers)."""
    files, scalars, generators = {}, {}, {}
    entries: list[FragmentEntry] = []
    for name in parts:
        part = json.loads((folder / f"{name}.json").read_text())
        files[part["file"]] = {"bytes": part["bytes"], "sha256": part["sha256"]}
        if "rng" in part:   # by rank number, as Checkpoint.restore_rng looks it up
            generators[name.removeprefix("rank")] = part["rng"]
        entries += part["entries"]
        scalars.update(part["scalars"])
    dtypes = {e["name"]: e["dtype"] for e in entries if e["key"] == PARAM}
    params: dict[str, ParamEntry] = {
        name: {"shape": list(shape), "numel": int(torch.Size(shape).numel()), "dtype": dtypes.get(name),
               "scalars": scalars.get(name, {})} for name, shape in shapes.items()}
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
            "state_keys": sorted(k for k in keys - {PARAM} if not private(k)), "params": params, "files": files,
            "state": state, "rng": generators,
            "config": config, "fragments": entries}
    with open(folder / METADATA, "w") as f:
        f.write(json.dumps(meta, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for name in parts:
        (folder / f"{name}.json").unlink()
    kept = {steps_file(folder, int(p.removeprefix("rank"))).name for p in parts if p.startswith("rank")}
    for leftover in folder.iterdir():
        if leftover.name not in files and leftover.name not in kept and leftover.name != METADATA:
            leftover.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
