"""The clicks source's hidden model (which id holds which Zipf rank, the true per-row and dense weights), built
once per machine and mapped by every rank instead of built by each: at 4 tables x 2e6 rows it is 128 MB
(int64 ranks -> ids, float64 weights), which every worker of a run held a copy of.

The launcher writes it (raw .npy arrays, no pickle, beside a JSON key) into a folder it names in $PSARCH_CLICKS_HIDDEN
for the ranks it spawns; a rank whose key matches maps the arrays read-only (np.load mmap_mode="r"), so the page
cache holds one copy and each rank only the pages its samples touch. The arrays are the ones `build` makes, bit for
bit: the data does not depend on who built them."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

ENV = "PSARCH_CLICKS_HIDDEN"
ROW_STD = 1.0         # spread of the true per-row weights w_t[i]
DENSE_STD = 0.5       # spread of the true dense term v·x


@dataclass
class HiddenModel:
    """perm[t, k]: the id of Zipf rank k in table t; row_weights[t, i]: w_t[i]; dense_weights: v."""

    perm: torch.Tensor
    row_weights: torch.Tensor
    dense_weights: torch.Tensor


def build(num_tables: int, rows: int, dense: int, seed: int) -> HiddenModel:
    """The hidden model, fixed by the seed alone."""
    gen = torch.Generator().manual_seed(seed + 0xC11C)
    perm = torch.stack([torch.randperm(rows, generator=gen) for _ in range(num_tables)])
    row_weights = torch.randn(num_tables, rows, generator=gen, dtype=torch.float64) * ROW_STD
    v = torch.randn(dense, generator=gen, dtype=torch.float64)
    return HiddenModel(perm, row_weights, v * (DENSE_STD / v.norm()))  # v·x ~ N(0, DENSE_STD²) exactly


def _key(num_tables: int, rows: int, dense: int, seed: int) -> dict[str, int]:
    return {"num_tables": num_tables, "rows": rows, "dense": dense, "seed": seed}


def write(folder: Path, num_tables: int, rows: int, dense: int, seed: int) -> None:
    """Build the hidden model and write it into `folder` (the key last: a reader sees all or nothing)."""
    folder.mkdir(parents=True, exist_ok=True)
    hidden = build(num_tables, rows, dense, seed)
    for name in ("perm", "row_weights", "dense_weights"):
        np.save(folder / f"{name}.npy", getattr(hidden, name).numpy(), allow_pickle=False)
    (folder / "key.json").write_text(json.dumps(_key(num_tables, rows, dense, seed)))


def load(num_tables: int, rows: int, dense: int, seed: int) -> HiddenModel:
    """The hidden model mapped from $PSARCH_CLICKS_HIDDEN when it holds this one, else built here."""
    folder = os.environ.get(ENV)
    if folder:
        try:
            key = json.loads((Path(folder) / "key.json").read_text())
        except (OSError, ValueError):
            key = None
        if key == _key(num_tables, rows, dense, seed):
            with warnings.catch_warnings():   # read-only by design: nothing writes into the hidden model
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                arrays = {n: torch.from_numpy(np.load(Path(folder) / f"{n}.npy", mmap_mode="r", allow_pickle=False))
                          for n in ("perm", "row_weights", "dense_weights")}
            return HiddenModel(**arrays)
    return build(num_tables, rows, dense, seed)


@contextlib.contextmanager
def shared(folder: Path, num_tables: int, rows: int, dense: int, seed: int) -> Iterator[None]:
    """Within: processes started here map the hidden model written into `folder` (removed after)."""
    folder = folder.resolve()   # (a rank might not share the launcher's working directory)
    write(folder, num_tables, rows, dense, seed)
    before = os.environ.get(ENV)
    os.environ[ENV] = str(folder)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        shutil.rmtree(folder, ignore_errors=True)
