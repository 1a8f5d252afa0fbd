"""Each backend's measured memory and traffic agree with the estimator's prediction for the same run.

Measured model-state bytes lie in [predicted, predicted + padding + counters]: padding is what each
backend adds to split buffers evenly (reported in `memory.padding`), counters AdamW's step counters,
4 B per stepped tensor, at most one per parameter tensor (flat backends step one or a few). Measured
bytes per step (ring: counted on the wire; PS: every frame) lie in [predicted, 1.01 x predicted + 64 B]:
padding to multiples of N, and message headers for the PS (about 100 B per message against S = 8.6 KB
here). GEO pushes once every k steps: its prediction is S/k per step."""
from __future__ import annotations

import pytest

import psarch
from psarch.config import from_dict
from psarch.workload import build_workload

TINY = {"seed": 2, "workload": {"model": "gpt", "seq_len": 8, "gpt": {"n_layer": 2, "n_embd": 16, "n_head": 2},
                                "markov": {"vocab_size": 16}},
        "train": {"steps": 3, "global_batch": 6, "optimizer": "adamw", "log_every": 100}}
POINTS = {"single": {"kind": "single", "world_size": 1},
          "ddp": {"kind": "ddp", "comm": "ring"}, "zero1": {"kind": "zero", "stage": 1},
          "zero2": {"kind": "zero", "stage": 2}, "zero3": {"kind": "zero", "stage": 3},
          "ps": {"kind": "ps", "mode": "sync", "servers": 2},
          "ps_async": {"kind": "ps", "mode": "async", "servers": 2},
          # GEO: a local optimizer and the last synced fp32 copy on every worker; 4 steps = 2 rounds of k = 2
          "ps_geo": {"kind": "ps", "mode": "geo", "servers": 1, "k_steps": 2, "geo_barrier": True}}


@pytest.mark.parametrize("point", list(POINTS))
def test_measured_agrees_with_prediction(tmp_path, point):
    train = dict(TINY["train"], steps=4) if point == "ps_geo" else TINY["train"]
    cfg = from_dict(dict(TINY, name=point, train=train, backend={"world_size": 3, **POINTS[point]}))
    s = psarch.run(cfg, out=tmp_path / point, echo=False)
    counters = 4 * len(list(build_workload(cfg).model.parameters()))
    predicted_mem = s["predicted"]["memory_per_rank"]["total"]
    for m in s["memory"]["per_rank"]:
        assert predicted_mem <= m["total"] <= predicted_mem + m["padding"] + counters, (point, m, predicted_mem)
    predicted_sent = s["predicted"]["traffic_per_step"]["worker_sent"]
    for t in s["traffic"]["per_rank"]:
        assert predicted_sent <= t["sent_per_step"] <= 1.01 * predicted_sent + 64, (point, t, predicted_sent)
    if point == "ps_geo":
        assert s["predicted"]["memory_per_rank"]["buffers"] == 4 * s["params"]
    if point.startswith("ps"):
        servers = s["traffic"]["servers"]
        per_server = s["predicted"]["traffic_per_step"]["server_received"]
        for srv in servers:
            assert per_server * 0.9 <= srv["received"] / s["steps"] <= 1.01 * per_server * 1.1 + 64
        # the servers' memory: their ranges, optimizer state and buffers (+ AdamW's 4-byte step counter each)
        held = sum(m["total"] for m in s["memory"]["servers"])
        predicted = len(servers) * s["predicted"]["server_memory"]
        assert predicted <= held <= predicted + 4 * len(servers), (point, held, predicted)
