"""samples/s means one thing (psarch/throughput.py) in the summary, report.txt, `psarch compare`, the straggler
tables and the progress line, and each says which: the global batch over the median step where workers step
in lockstep, the sum of each worker's own rate where they run at their own pace. No processes."""
from __future__ import annotations

from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.launch.outputs import report
from psarch.launch.progress import Progress, rank_losses
from psarch.throughput import LOCKSTEP, OWN_PACE, RANK_0, definition, samples_per_s
from psarch.trainer import StepStats

# worker 0 takes 4 s a step, worker 1 takes 1 s; 8 samples a step, 4 each
SLOW = [{"rank": 0, "step": s, "step_time_s": 4.0, "loss": 1.0} for s in range(5)]
FAST = [{"rank": 1, "step": s, "step_time_s": 1.0, "loss": 1.0} for s in range(5)]
MERGED = [{"step": s, "loss": 1.0, "step_time_s": 4.0, "workers": [a, b]} for s, (a, b) in enumerate(zip(SLOW, FAST))]


def test_lockstep_is_the_global_batch_over_the_median_step_own_pace_the_sum_of_rates():
    assert samples_per_s(MERGED, 8, lockstep=True, warmup=0) == 2.0          # 8 / 4 s: the slowest sets the pace
    assert samples_per_s(MERGED, 8, lockstep=False, warmup=0) == 5.0         # 4 / 4 s + 4 / 1 s
    assert definition(True) == LOCKSTEP and definition(False) == OWN_PACE
    warm = [dict(MERGED[0], step_time_s=100.0, workers=[dict(SLOW[0], step_time_s=100.0), FAST[0]])] + MERGED[1:]
    assert samples_per_s(warm, 8, lockstep=True, warmup=1) == 2.0            # the warm-up step is left out
    assert samples_per_s(warm, 8, lockstep=False, warmup=1) == 5.0
    one = [{"step": s, "loss": 1.0, "step_time_s": 0.5} for s in range(3)]  # one worker: the row is its own
    assert samples_per_s(one, 8, lockstep=False, warmup=0) == samples_per_s(one, 8, lockstep=True, warmup=0) == 16.0


def _progress_line(capsys, lockstep: bool, world: int) -> str:
    cfg = from_dict({"train": {"steps": 4, "log_every": 4, "global_batch": 32}})
    ctx = DistContext(rank=0, world_size=world)
    log = Progress(cfg, ctx, None, echo=True, lockstep=lockstep, losses=rank_losses(cfg, ctx, False, None, True))
    records = [{"step": s, "loss": 2.0, "step_time_s": t, "sent": 0, "skipped": False}
               for s, t in enumerate([0.1, 0.2, 0.1, 5.0])]
    log.after(3, records, StepStats(2.0))
    return capsys.readouterr().out


def test_the_progress_line_says_which_samples_per_s_as_the_summary_does(capsys):
    """Steps of 0.1, 0.2, 0.1 and 5 s: the median step is 0.15 s, so 32 / 0.15 = 213.3 samples/s in lockstep,
    in the summary's words; a worker at its own pace shows its own shard's rate (8 of 32) and says so."""
    assert "213.3 samples/s (global batch / median step time)" in _progress_line(capsys, True, 4)
    assert f"53.3 samples/s ({RANK_0})" in _progress_line(capsys, False, 4)
    summary = {"name": "z", "label": "ddp ring", "backend": "ddp", "variant": "ring", "world_size": 2, "servers": 0,
               "workload": "gpt", "params": 20, "precision": "fp32", "optimizer": "sgd", "final_loss": 1.0,
               "skipped_steps": 0, "step_time_s": 0.15, "samples_per_s": 213.33, "samples_per_s_is": LOCKSTEP,
               "predicted": {"memory_per_rank": {"total": 60}, "traffic_per_step": {"worker_sent": 1}},
               "memory": {"per_rank": [{"rank": 0, "params": 1, "grads": 1, "optimizer": 1, "total": 3}]},
               "traffic": {"per_rank": [{"sent_per_step": 1}]}}
    assert "213.3 samples/s (global batch / median step time)" in report(summary)
