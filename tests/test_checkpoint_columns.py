"""Checkpoint fragments that are column blocks (psarch.checkpoint.fragments.Fragment.columns): a row-parallel
linear's shard holds the same columns of every row, which is no one flat range of the parameter. Pure unit
tests: files written and read in one process."""
from __future__ import annotations

import json

import pytest
import torch

from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import PARAM, Fragment, Pieces
from psarch.checkpoint.reader import CheckpointError
from psarch.checkpoint.writer import merge, write_part


def test_column_blocks_reassemble_into_any_range_and_fill_any_other_split(tmp_path):
    """A 5 x 6 weight written as three ranks' column blocks (columns [0, 2), [2, 4), [4, 6) of every row):
    every flat range reads back, and the shards of a split into 1, 2, 3 or 6 column blocks, into row ranges,
    or a strided column block, fill from them."""
    weight, ranks = torch.randn(5, 6), 3
    for r in range(ranks):
        block = weight[:, 2 * r:2 * r + 2].contiguous()
        write_part(Pieces([Fragment("w", (5, 6), 2 * r, {PARAM: block.view(-1), "sum": (2 * block).view(-1)},
                                    columns=(2 * r, 2 * r + 2))], {"w": (5, 6)}), tmp_path, f"rank{r}")
    merge(tmp_path, [f"rank{r}" for r in range(ranks)], 1, {}, {"w": (5, 6)}, {}, ranks)
    ckpt = Checkpoint(tmp_path)
    ckpt.verify()
    assert [e["columns"] for e in ckpt.meta["fragments"] if e["key"] == PARAM] == [[0, 2], [2, 4], [4, 6]]
    flat = weight.view(-1)
    for lo in range(30):
        for hi in range(lo + 1, 31):
            assert torch.equal(ckpt.read("w", PARAM, lo, hi), flat[lo:hi]), (lo, hi)
    for other in (1, 2, 3, 6):
        width = 6 // other
        for r in range(other):
            got = torch.empty(5, width)
            ckpt.fill(Fragment("w", (5, 6), r * width, {"sum": got.view(-1)}, columns=(r * width, (r + 1) * width)))
            assert torch.equal(got, 2 * weight[:, r * width:(r + 1) * width]), (other, r)
    rows = torch.empty(2, 6)   # rows 1 and 2: one flat range
    ckpt.fill(Fragment("w", (5, 6), 6, {PARAM: rows.view(-1)}))
    assert torch.equal(rows, weight[1:3])
    strided = torch.empty(2, 2)   # columns [3, 5) of rows 1 and 3
    ckpt.fill(Fragment("w", (5, 6), 6 + 3, {PARAM: strided.view(-1)}, row_stride=2, columns=(3, 5)))
    assert torch.equal(strided, weight[1:4:2, 3:5])
    ckpt.close()


@pytest.mark.parametrize("edit, says", [({"columns": [2, 2], "offset": 2}, r"columns \[2, 2\] of 'w' are not \[c0, c1\]"),
                                        ({"columns": [2, 7], "offset": 2}, r"columns \[2, 7\] of 'w' are not \[c0, c1\]"),
                                        ({"offset": 3}, r"is not whole rows of a 2-D parameter \(columns \[2, 6\]")])
def test_a_bad_column_block_is_refused_in_one_line(tmp_path, edit, says):
    weight = torch.randn(4, 6)
    write_part(Pieces([Fragment("w", (4, 6), 0, {PARAM: weight[:, :2].reshape(-1)}, columns=(0, 2)),
                       Fragment("w", (4, 6), 2, {PARAM: weight[:, 2:].reshape(-1)}, columns=(2, 6))],
                      {"w": (4, 6)}), tmp_path, "rank0")
    merge(tmp_path, ["rank0"], 1, {}, {"w": (4, 6)}, {}, 1)
    meta = json.loads((tmp_path / "metadata.json").read_text())
    meta["fragments"][1].update(edit)
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=says) as e:
        Checkpoint(tmp_path)
    assert "\n" not in str(e.value)
