"""Stragglers: a slow worker sleeps (slowdown - 1) x its measured compute time before it communicates;
jitter is seeded; sync's step time follows the slowest worker, async's throughput the sum of speeds."""
from __future__ import annotations

import json
import statistics
import time

import torch

from collective.comm import Handle
from parity import config
from psarch.cluster.stragglers import Straggler, straggler
from psarch.config import from_dict
from psarch.launch.ranks import run
from psarch.workload import build_workload


def _loss_taking(seconds: float):
    w = torch.ones(3, requires_grad=True)

    def loss_fn(model, batch):
        time.sleep(seconds)            # the "forward pass"
        return (w * batch).sum()
    return loss_fn


def test_sleep_is_slowdown_minus_one_times_measured_compute():
    s = Straggler(3.0, 0.0, seed=0, rank=0)
    loss_fn = s.wrap(_loss_taking(0.02))
    t0 = time.perf_counter()
    loss = loss_fn(None, torch.ones(3))
    assert s.forward_s >= 0.02 and s.slept_s == 2 * (3 * s.forward_s)   # first step: backward taken as 2 x forward
    assert time.perf_counter() - t0 >= 0.02 + s.slept_s                 # it did sleep
    loss.backward()
    assert s.backward_s is not None and 0 < s.backward_s < s.forward_s   # measured: this backward is cheap
    loss_fn(None, torch.ones(3))
    assert s.slept_s == 2 * (s.forward_s + s.backward_s)                 # now forward + the measured backward


class _SlowComm:
    """One rank's collectives (N = 1: copies), each taking `wait_s` to finish, as over a slow link."""

    rank, world_size = 0, 1

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s

    def _finish(self, async_op: bool) -> Handle | None:
        if async_op:
            return Handle(lambda: time.sleep(self.wait_s), lambda: False)
        time.sleep(self.wait_s)
        return None

    def broadcast(self, tensor, src=0, async_op=False):
        return None

    def all_gather(self, output, input, async_op=False):
        output.copy_(input)
        return self._finish(async_op)

    def reduce_scatter(self, output, input, async_op=False):
        output.copy_(input)
        return self._finish(async_op)


def _zero3_straggler(wait_s: float) -> tuple[float, float]:
    """(the second step's sleep, the waits the engine timed) of a ZeRO-3 worker 2x slower, every gather
    and reduce-scatter blocking (no prefetch, no overlap) for `wait_s` inside forward and backward."""
    from zero.stage3 import Stage3
    from psarch.model_units import find_units

    wl = build_workload(from_dict(config("zero3", workload={"gpt": {"n_layer": 2, "n_embd": 16, "n_head": 2}})))
    engine = Stage3(wl.model, find_units(wl.model), _SlowComm(wait_s), prefetch_numel=0, overlap_comm=False)
    s = Straggler(2.0, 0.0, seed=0, rank=0)
    s.waited = lambda: engine.waits.total_s      # what the runner wires: trainer.comm_waited_s
    loss_fn = s.wrap(wl.loss_fn)
    for step in range(2):
        engine.begin_step()
        loss_fn(wl.model, wl.batch(step, 0, 1)).backward()
        engine.reduce_gradients()
    engine.close()
    return s.slept_s, engine.waits.total_s


def test_zero_waits_are_not_compute():
    """ZeRO-3 waits for its all-gathers in forward and backward and for its reduce-scatters in backward's
    hooks; the engine times them, so a slow worker's sleep is (slowdown - 1) x compute alone and does not
    grow with communication time (counted as compute, 0.1 s per collective would add ~1 s here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)       # one rank's compute, as the launcher runs it: not oversubscribed cores
    try:
        fast_link, slow_link = _zero3_straggler(0.0), _zero3_straggler(0.1)
    finally:
        torch.set_num_threads(threads)
    assert slow_link[1] >= 8 * 0.1                     # the engine timed every wait: 4 gathers, 2 + 2 in backward
    assert abs(slow_link[0] - fast_link[0]) < 0.15, (fast_link, slow_link)


def test_jitter_is_a_function_of_seed_rank_and_step_and_only_slows():
    def draws(seed: int, rank: int, steps: range = range(20)) -> list[float]:
        s = Straggler(1.0, 0.5, seed, rank)
        return [s.factor(step) for step in steps]

    assert draws(1, 0) == draws(1, 0)                     # two runs of one config: the same slow steps
    assert draws(1, 0) != draws(1, 1) and draws(1, 0) != draws(2, 0)
    assert draws(1, 0, range(12, 20)) == draws(1, 0)[12:]  # a run resumed at step 12 too
    assert len(set(draws(1, 0))) == 20                    # a new draw each step
    s = Straggler(1.0, 0.5, 1, 0)
    loss_fn = s.wrap(_loss_taking(0.0))
    slept = []
    for s.step in range(20):
        loss_fn(None, torch.ones(3))
        slept.append(s.slept_s)
    assert min(slept) == 0.0 and all(x >= 0 for x in slept)


def test_the_runner_draws_each_steps_jitter_resumed_or_not(tmp_path):
    from unittest import mock

    from psarch.dist import DistContext
    from psarch.launch.runner import run_rank

    data = config("jitter", workload={"factory": "factories:regression"}, cluster={"jitter": 0.1},
                  train={"steps": 4, "checkpoint_every": 2})
    asked = []
    with mock.patch.object(Straggler, "factor", autospec=True, side_effect=lambda s, step: asked.append(step) or 1.0):
        run_rank(from_dict(data), DistContext(), echo=False, checkpoints=tmp_path)
        run_rank(from_dict(data), DistContext(), echo=False, start=tmp_path / "step_000002", resume=True)
    assert asked == [0, 1, 2, 3, 2, 3]


def test_who_is_slowed():
    cfg = from_dict({"backend": {"kind": "ddp", "world_size": 3}, "train": {"global_batch": 12},
                    "cluster": {"slow_workers": [1], "slowdown": 2.0}})
    assert straggler(cfg, 0) is None and straggler(cfg, 1).slowdown == 2.0
    assert straggler(from_dict({}), 0) is None                          # the default: nobody
    jittery = from_dict({"backend": {"kind": "ddp", "world_size": 3}, "train": {"global_batch": 12},
                        "cluster": {"jitter": 0.1}})
    assert all(straggler(jittery, r).slowdown == 1.0 for r in range(3))


def _worker_step_times(out) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][3:]
    return [statistics.median(r["workers"][w]["step_time_s"] for r in rows) for w in range(2)]


def test_sync_follows_the_slowest_async_the_sum(tmp_path):
    """Worker 0 computes 8x slower. Sync: the fast worker waits, so its step takes >= 70% of the slow one's.
    Async: the fast worker runs at its own pace (<= 50% of the slow one's step) and the samples/s of
    both together beat sync's by >= 1.5x (ideally (1 + 8) / 2 = 4.5x)."""
    times, rates = {}, {}
    for mode in ("sync", "async"):
        cfg = from_dict(config(mode, backend={"kind": "ps", "world_size": 2, "mode": mode},
                               train={"steps": 12, "global_batch": 16},
                               workload={"gpt": {"n_layer": 2, "n_embd": 64, "n_head": 4}, "seq_len": 32},
                               cluster={"slow_workers": [0], "slowdown": 8.0}))
        run(cfg, tmp_path / mode, echo=False)
        times[mode] = _worker_step_times(tmp_path / mode)
        rates[mode] = sum(8 / t for t in times[mode])      # each worker's shard is 8 samples
    slow, fast = times["sync"]
    assert fast >= 0.7 * slow, times
    slow, fast = times["async"]
    assert fast <= 0.5 * slow, times
    assert rates["async"] >= 1.5 * (16 / max(times["sync"])), (rates, times)


def test_straggler_results_count_each_worker_at_its_own_pace():
    """Worker 0 takes 4 s a step, worker 1 takes 1 s and its loss falls first: samples/s sums both paces
    (4/4 + 4/1 samples/s with 4 samples each) and the target is met when the last 2 losses in time order
    (window 1 x N = 2) average below it: at t = 4 s, where a step-merged clock would say 8 s."""
    from psarch.report.stragglers import events, final_gap, per_worker, time_to_gap
    from psarch.throughput import samples_per_s

    slow = [{"rank": 0, "step": s, "step_time_s": 4.0, "loss": 3.0} for s in range(4)]
    fast = [{"rank": 1, "step": s, "step_time_s": 1.0, "loss": loss} for s, loss in enumerate([3.0, 2.0, 1.0, 1.0])]
    merged = [{"step": s, "loss": (a["loss"] + b["loss"]) / 2, "step_time_s": 4.0, "workers": [a, b]}
              for s, (a, b) in enumerate(zip(slow, fast))]
    workers = per_worker(merged)
    assert workers == [slow, fast]
    assert samples_per_s(merged, global_batch=8, lockstep=False, warmup=0) == 5.0
    assert [t for t, _ in events(workers)] == [1, 2, 3, 4, 4, 8, 12, 16]
    assert time_to_gap(workers, floor=0.0, target=1.5, window=1) == 4.0
    assert time_to_gap(workers, floor=0.5, target=1.5, window=1) == 3.0     # (2 + 1) / 2 - 0.5 < 1.5
    assert time_to_gap(workers, floor=0.0, target=1.0, window=1) is None
    assert final_gap(workers, floor=0.5, last=1) == 2.5
