"""Compressed PS runs in checkpoints (psarch/ps/snapshot.py): GEO with compressed pulls (the servers' copies of what
each worker holds, psarch/ps/server/deltas.py, and whether a delta was sent) and top-k pushes (each worker's error
feedback, psarch/ps/worker/topk.py). A run checkpointed at step 4 and resumed ends with the uninterrupted run's model,
bit for bit: GEO with the barrier (deterministic), k_steps = 2, 2 workers, 2 servers, top-k 0.1 (and with
partitions), fp16, top-k beside the PS's embedding rows (DLRM, backend.embeddings = "rows": the dense delta
compressed, the rows whole), and the sync PS with top-k. The checkpoint holds that state, and it matters: the
copies differ from the parameters (what the pulls left out) and the error feedback is not zero, so a resume without
them would differ."""
from __future__ import annotations

import pytest
import torch

from parity import config
from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import PARAM
from psarch.config import from_dict
from psarch.launch.ranks import run
from ps_setup import ps
from test_ps_rows import ROWS_DLRM

SGD = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}
GEO = {"k_steps": 2, "geo_barrier": True}
CASES = {   # name -> (train, backend)
    "geo-topk": ({"compression": "topk", "topk_ratio": 0.1}, ps(2, "geo", 2, **GEO)),
    "geo-topk-parts": ({"compression": "topk", "topk_ratio": 0.1}, ps(2, "geo", 2, partition_mb=0.001, **GEO)),
    "geo-fp16": ({"compression": "fp16"}, ps(2, "geo", 2, **GEO)),
    "sync-topk": ({"compression": "topk", "topk_ratio": 0.1}, ps(2, "sync", 2)),
    "geo-topk-rows": ({"compression": "topk", "topk_ratio": 0.1}, ps(2, "geo", 2, embeddings="rows", **GEO)),
}


def _cfg(case: str, **train):
    t, b = CASES[case]
    if b.get("embeddings") == "rows":   # row-wise SGD has no momentum
        return from_dict(config(case, base=ROWS_DLRM, train=dict(SGD, momentum=0.0, **t, **train), backend=b))
    return from_dict(config(case, train=dict(SGD, **t, **train), backend=b))


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_compressed_ps_run_is_the_uninterrupted_one(case, tmp_path):
    run(_cfg(case, steps=8), tmp_path / "full", echo=False)
    run(_cfg(case, steps=4, checkpoint_every=4), tmp_path / "half", echo=False)
    ckpt = Checkpoint(tmp_path / "half" / "checkpoints" / "step_000004")
    dense = [n for n in ckpt.params if not n.startswith("tables.")]   # (a row server's tables: no copy, no feedback)
    try:
        def read(name: str, key: str) -> torch.Tensor:
            return ckpt.read(name, key, 0, ckpt.params[name]["numel"])

        if case.startswith("geo"):   # the barrier's one copy: what every worker holds, short of the parameters
            assert all(ckpt.has(n, "geo_copy/0") and not ckpt.has(n, "geo_copy/1") for n in dense)
            assert any(not torch.equal(read(n, "geo_copy/0"), read(n, PARAM)) for n in dense)
        if "topk" in case:   # each worker's error feedback
            assert all(sum(read(n, f"worker{r}/topk_error").abs().sum() for n in dense) > 0 for r in range(2))
    finally:
        ckpt.close()
    run(_cfg(case, steps=8, checkpoint_every=4), tmp_path / "half", echo=False, resume=True)
    a = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "half" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), case
