"""faults.restart = "shrink": a collective world that loses a rank restarts at N - 1 from the newest checkpoint in
the same run folder, as torchrun's elastic agent does when a node does not come back. The global batch is kept
(cut in N - 1 shards), so the shrunk run equals a run that trained at N to the checkpoint and then at N - 1 from
it (a fork, --from), bit for bit; what cannot shrink is refused in one line before anything starts."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import psarch
from cluster_setup import leftovers, needs_root, watchers
from parity import assert_same_model, config
from psarch.config import ConfigError, from_dict
from psarch.launch.faults import at_world
from psarch.launch.ranks import run
from psarch.theory import world_step
from test_faults import SGD, _cfg
from test_ps_faults import _children

TRAIN = {"momentum": 0.9, "checkpoint_every": 2}
SHRINK = {"kill": [{"node": "worker 2", "step": 5}], "restart": "shrink"}


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend, fault, train, error", [
    ({"kind": "pipeline", "stages": 2, "world_size": 2}, SHRINK | {"kill": [{"node": "worker 1", "step": 5}]}, TRAIN,
     r'faults.restart = "shrink": backend.kind = "pipeline" cuts the model into backend.pipeline_stages stages'),
    ({"kind": "tensor", "comm": "ring", "world_size": 2}, SHRINK | {"kill": [{"node": "worker 1", "step": 5}]}, TRAIN,
     r'faults.restart = "shrink": backend.kind = "tensor" splits every layer over backend.tp_size ranks'),
    ({"kind": "ddp", "world_size": 3}, SHRINK, dict(TRAIN, global_batch=9),
     r'faults.restart = "shrink": worker 2 killed at step 5 restarts the world at backend.world_size = 2, where '
     r'train.global_batch = 9: must be divisible by backend.world_size = 2$'),
    ({"kind": "ddp", "world_size": 3}, SHRINK | {"pause": [{"node": "worker 0", "step": 5, "seconds": 1}]}, TRAIN,
     r'worker 0 pause at step 5, the step worker 2 is killed; a world that shrinks stops at a kill'),
    ({"kind": "ddp", "world_size": 3}, SHRINK | {"kill": [{"node": "worker 2", "step": 3},
                                                          {"node": "worker 2", "step": 5}]}, TRAIN,
     r'worker 2 killed at step 3 restarts the world at backend.world_size = 2, where faults.kill\[0\].node = '
     r'"worker 2": unknown node; workers are 0..1'),
    ({"kind": "ddp", "world_size": 3}, SHRINK, {},
     r'faults.restart = "shrink": restarts from the newest checkpoint, so it needs train.checkpoint_every > 0'),
])
def test_a_world_that_cannot_shrink_is_refused_in_one_line(backend, fault, train, error):
    with pytest.raises(ConfigError, match=error) as e:   # two blocks: a pipeline of 2 stages needs them
        _cfg("bad", backend, fault, train=train, workload={"gpt": {"n_layer": 2, "n_embd": 16, "n_head": 2}})
    assert "\n" not in str(e.value)


def test_a_second_kill_names_a_rank_of_the_shrunk_world():
    """Ranks are renumbered 0..N-2 after a shrink: worker 1 of the 2-rank world may be killed next (to N = 1)."""
    cfg = _cfg("twice", {"kind": "ddp", "world_size": 3}, SHRINK | {"kill": [{"node": "worker 2", "step": 3},
                                                                              {"node": "worker 1", "step": 5}]},
               train=TRAIN)
    assert cfg.faults.restart == "shrink"


DDP = {"kind": "ddp", "world_size": 3, "comm": "ring", "timeout_s": 5.0}


@pytest.mark.parametrize("backend, cluster", [
    (DDP, {}), ({"kind": "zero", "world_size": 3, "stage": 2, "timeout_s": 5.0}, {}),
    pytest.param(DDP, {"emulate": True, "link_mbps": 200.0}, marks=needs_root, id="emulated")])
def test_a_shrunk_run_equals_training_at_n_to_the_checkpoint_then_at_n_minus_1_from_it(tmp_path, backend, cluster):
    """Worker 2 of 3 killed as step 5 begins: the world restarts at N = 2 from checkpoint 4 and finishes. Its model
    is, bit for bit, that of a run at N = 3 to step 4 forked (--from) at N = 2 from that checkpoint (ZeRO's
    optimizer shards resharded from 3 to 2); its metrics hold every step once, steps 0..3 over the 3 ranks and
    equal to the full run's, steps 4..7 over 2 and equal to the fork's."""
    full = psarch.run(from_dict(config("full", train=dict(SGD, **TRAIN), backend=backend, cluster=cluster)),
                      tmp_path / "full", echo=False)
    at2 = dict(backend, world_size=2)
    fork = run(from_dict(config("fork", train=dict(SGD, **TRAIN), backend=at2, cluster=cluster)), tmp_path / "fork",
               echo=False,
               start=tmp_path / "full" / "checkpoints" / "step_000004")
    out = tmp_path / "shrunk"
    summary = psarch.run(_cfg("shrunk", backend, SHRINK, train=TRAIN, cluster=cluster), out, echo=False)
    assert _children() == [] and not leftovers(os.getpid()) and not watchers(os.getpid())
    assert summary["status"] == "finished" and summary["steps"] == 8 and summary["world_size"] == 2
    [restart] = summary["restarts"]
    assert restart["world_size"] == 2 and restart["from_step"] == 4 and restart["steps_lost"] == 1
    assert restart["error"].startswith("rank 2 was killed by SIGKILL")
    report = (out / "report.txt").read_text()
    assert "restart: from step 4 at " in report and ", N = 2 (" in report and "N=2," in report.splitlines()[0]
    assert [len(r["memory"]["per_rank"]) for r in (summary, full)] == [2, 3]
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(8))
    assert [len(r["workers"]) for r in rows] == [3] * 4 + [2] * 4
    assert [r["loss"] for r in rows[:4]] == [r["loss"] for r in _rows(tmp_path / "full")[:4]]
    assert [r["loss"] for r in rows[4:]] == [r["loss"] for r in _rows(tmp_path / "fork")]
    assert fork["steps"] == 4 and full["steps"] == 8
    assert_same_model(torch.load(out / "model.pt", weights_only=True),
                      torch.load(tmp_path / "fork" / "model.pt", weights_only=True), "shrunk vs fork at N = 2",
                      rtol=0.0, atol=0.0)
    # what it cost, predicted at N - 1's step: the first world's, times the simulator's ratio at 2 to 3 ranks
    [cost] = summary["failure_cost"]["restarts"]
    final = at_world(_cfg("shrunk", backend, SHRINK, train=TRAIN, cluster=cluster), 2)
    ratio = world_step(final, summary, 2) / world_step(final, summary, 3)
    assert [w["world_size"] for w in summary["worlds"]] == [3, 2] and cost["world_size"] == 2 and ratio > 1
    assert cost["step_predicted_s"] == pytest.approx(summary["worlds"][0]["step_time_s"] * ratio)
    assert summary["failure_cost"]["goodput_predicted_steps_per_s"] > 0
