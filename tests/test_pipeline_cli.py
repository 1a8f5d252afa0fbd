"""End to end: `psarch run` of a pipeline (spawned ranks, the launcher's own path) writes summaries whose
report and `psarch compare` show each stage beside its own prediction: model states, bytes, idle fraction
and activations held."""
from __future__ import annotations

import json

import psarch
from psarch.report.compare import compare
from psarch.config import from_dict
from psarch.launch.outputs import report

RUN = {"seed": 0, "workload": {"model": "gpt", "seq_len": 8, "gpt": {"n_layer": 2, "n_embd": 16, "n_head": 2},
                               "markov": {"vocab_size": 16}},
       "train": {"steps": 4, "global_batch": 8, "log_every": 100},
       "backend": {"kind": "pipeline", "world_size": 2, "schedule": "gpipe", "microbatches": 4}}


def test_run_report_and_compare_show_each_stage(tmp_path):
    summary = psarch.run(from_dict(dict(RUN, name="pp")), out=tmp_path / "pp", echo=False)
    per = summary["predicted"]["per_rank"]
    assert summary["label"] == "pipeline gpipe p2 m4" and len(per) == 2
    # each rank's own prediction in the report: stage 0 holds the embeddings, stage 1 the head
    rows = report(summary).splitlines()[-2:]
    for rank, row in enumerate(rows):
        assert row.split()[0] == str(rank)
        mine = summary["memory"]["per_rank"][rank]["total"]
        assert mine == per[rank]["memory"]["total"] + 4   # + AdamW's step count (one fp32 for the flat master)
    assert per[0]["memory"]["total"] != per[1]["memory"]["total"]
    extra = summary["extra"]
    assert extra["activations_held"] == [r["activations_held"] for r in per]   # exact at this size
    assert all(0.0 <= f < 1.0 for f in extra["idle_fraction"])
    text = compare([tmp_path / "pp"], tmp_path / "cmp").read_text()
    section = text.split("## Per rank")[1].split("##")[0]
    assert "idle fraction measured \\| predicted" in section and "activations held" in section
    assert section.count("| pp | pipeline gpipe p2 m4 |") == 2 and "20.0%" in section   # (p-1)/(m+p-1) = 1/5
    metrics = [json.loads(line) for line in (tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()]
    assert all(len({w["loss"] for w in r["workers"]}) == 1 for r in metrics)   # every rank, the same loss
