"""Step time on an emulated cluster as theory predicts it (psarch.theory.cluster_step_time and each backend's
CommModel): the α-β sum by hand, a PS's pipelined exchange filling and draining with its largest partition, the
share of backward that hides a PS server's exchange, ZeRO's all-gather after the optimizer step, and every
backend's model."""
from __future__ import annotations

import pytest

from psarch.backend import CommModel
from psarch.config import from_dict


def test_cluster_step_time_by_hand():
    """S = 1 MB (250,000 fp32 parameters), N = 4, 100 Mbit/s (12.5 MB/s of frames, 1448/1514 of it
    payload), α = 0.1 ms, compute 50 ms, counted by hand."""
    from psarch.theory import cluster_step_time, config_for, predict

    def step(kind: str, stage: int = 1, servers: int = 1, placement: str = "dedicated", **kw) -> float:
        options = {"zero": {"stage": stage},
                   "ps": {"servers": servers, "partition_mb": 0.0, "server_placement": placement}}.get(kind, {})
        p = predict(config_for(kind, 1 if kind == "single" else 4, "fp32", "sgd", **options), 250_000)
        server_mbps, backward_s = kw.pop("server_mbps", 100.0), kw.pop("backward_s", None)
        return cluster_step_time(p, 0.05, 100.0, server_mbps, alpha_s=1e-4, model=CommModel(**kw),
                                 backward_s=backward_s)["step_time_s"]

    rate = 12.5e6 * 1448 / 1514           # payload bytes/s
    assert step("ddp") == pytest.approx(0.05 + 1.5e6 / rate + 6e-4)             # ring: 2(N-1)/N·S, 2(N-1) hops
    assert step("zero", stage=3) == pytest.approx(0.05 + 2.25e6 / rate + 9e-4)  # 3(N-1)/N·S, 3(N-1) hops
    assert step("zero", stage=3, hidden_passes=2) == pytest.approx(0.05 + 0.75e6 / rate + 3e-4)
    assert step("ps") == pytest.approx(0.05 + 2 * 4e6 / rate + 2e-4)           # one server's link: N·S each way
    assert step("ps", servers=4) == pytest.approx(0.05 + 2 * 1e6 / rate + 2e-4)  # N servers: S each
    assert step("ps", server_mbps=400.0) == pytest.approx(0.05 + 2 * 4e6 / (4 * rate) + 2e-4)
    # pipelined over m partitions per server: (push + pull) / m to fill and drain, (m - 1) / m of both at once
    for m in (1, 4, 25):
        assert step("ps", servers=4, pipeline=m) == pytest.approx(0.05 + (2 / m + (m - 1) / m) * 1e6 / rate + 2e-4)
        assert step("ps", pipeline=m) == pytest.approx(0.05 + (1 + 1 / m) * 4e6 / rate + 2e-4)
    # colocated, server i on worker i's node: 3/4 S of pushes out and 3/4 S in, then the same of pulls; pipelining
    # cannot help a node already busy both ways
    for m in (1, 25):
        assert step("ps", servers=4, placement="colocated", pipeline=m) == pytest.approx(0.05 + 1.5e6 / rate + 2e-4)
    # 2 servers beside workers 0 and 1: their nodes push S/2, receive 3/2 S; the workers alone push S
    assert step("ps", servers=2, placement="colocated") == pytest.approx(0.05 + 2 * 1.5e6 / rate + 2e-4)
    assert step("single") == 0.05
    # overlap: 4 buckets ready at 1/4, 2/4, 3/4 and the end of backward (2/3 of compute, or as given) on one
    # link: link-bound, it starts at 1/4 of backward and runs all of comm; compute-bound, the last bucket waits
    comm = 1.5e6 / rate + 6e-4
    assert step("ddp", buckets=4, overlap=True) == pytest.approx(0.05 + comm - 0.05 * 2 / 3 * 3 / 4)
    assert step("ddp", buckets=4, overlap=True, backward_s=0.02) == pytest.approx(0.05 + comm - 0.02 * 3 / 4)
    assert step("ddp", buckets=4, overlap=True, backward_s=1.0) == pytest.approx(0.05 + comm / 4)


def test_ps_pipeline_fills_and_drains_with_its_largest_partition():
    """k = N = 8 servers, each 202,624 fp32 parameters in partitions of 65,536 (3 full, one of 6,016): push and
    pull as a two-stage flow shop over the partitions, simulated here, take R + the largest partition, not
    R (1 + 1/4) as four equal partitions would."""
    from psarch import registry
    from psarch.theory import cluster_step_time, predict
    cfg = from_dict({"backend": {"kind": "ps", "world_size": 8, "servers": 8, "partition_mb": 0.25,
                                 "partition_assignment": "ranges"}, "train": {"optimizer": "sgd", "global_batch": 8}})
    phi = 8 * 202_624
    parts = [65_536] * 3 + [202_624 - 3 * 65_536]
    push_done = pull_done = 0.0                  # each stage takes a partition's bytes x N / k at the link's rate
    for x in parts:
        push_done += x
        pull_done = max(pull_done, push_done) + x
    m = registry.spec_of(cfg).comm_model(cfg, phi, {})
    rate = 100e6 / 8 * 1448 / 1514 / 4          # fp32 elements per second on a 100 Mbit/s link
    got = cluster_step_time(predict(cfg, phi), 0.0, 100.0, 100.0, 0.0,
                            CommModel(m.buckets, pipeline=m.pipeline))["comm_s"]
    assert pull_done == 202_624 + 65_536
    assert got == pytest.approx(8 * pull_done / rate)     # a server takes N = 8 workers' partitions


def test_ps_overlap_hides_behind_its_last_servers_share_of_backward():
    """S = 1 MB, N = k = 4 dedicated servers, each range in 4 partitions pushed from backward's hooks: a server's
    range is a contiguous quarter of the parameters, ready within a quarter of backward, so the last server's link
    starts only then (all four workers' pushes of it on that one link). Link-bound: backward hides 1/4 x 3/4 of it,
    not (B - 1)/B = 15/16; compute-bound: after backward wait the last partition's push and pull, 2/5 of the
    exchange, not 1/16. Counted by hand."""
    from psarch.theory import cluster_step_time, config_for, predict
    p = predict(config_for("ps", 4, "fp32", "sgd", servers=4, partition_mb=0.0), 250_000)
    rate = 12.5e6 * 1448 / 1514
    comm = (1 + 1 / 4) * 1e6 / rate           # pipelined over 4 slots: (push + pull) / 4 + 3/4 of both at once

    def exposed(backward_s: float) -> float:
        return cluster_step_time(p, 0.2, 100.0, 100.0, 0.0, CommModel(16, True, pipeline=4, ready_share=1 / 4),
                                 backward_s=backward_s)["comm_s"]
    assert exposed(0.08) == pytest.approx(comm - 0.08 / 4 * 3 / 4)
    assert exposed(1.0) == pytest.approx(comm * 2 / 5)
    cfg = from_dict({"backend": {"kind": "ps", "world_size": 4, "servers": 4, "partition_assignment": "ranges"}})
    from psarch import registry
    assert registry.spec_of(cfg).comm_model(cfg, 1_000_000, {}).ready_share == 0.25
    # partitions dealt round robin (the default): each server's are ready all through backward
    cfg = from_dict({"backend": {"kind": "ps", "world_size": 4, "servers": 4, "partition_mb": 0.25}})
    assert registry.spec_of(cfg).comm_model(cfg, 1_000_000, {}).ready_share == 1.0


def test_zero_all_gather_waits_for_the_optimizer_step():
    """ZeRO-1, S = 1 MB, N = 4, 100 Mbit/s, 4 buckets reduce-scattered from backward's hooks: the reduce-scatter
    (3/4 S, 3 hops) hides behind backward as DDP's buckets do, the all-gather of the updated parameters (3/4 S,
    3 hops) starts after the optimizer step and is exposed whole. Counted by hand."""
    from psarch.theory import cluster_step_time, config_for, predict
    p = predict(config_for("zero", 4, "fp32", "sgd", stage=1), 250_000)
    rate = 12.5e6 * 1448 / 1514
    one_pass = 0.75e6 / rate + 3e-4

    def exposed(backward_s: float) -> float:
        return cluster_step_time(p, 0.2, 100.0, 100.0, 1e-4, CommModel(4, True, after_passes=1),
                                 backward_s=backward_s)["comm_s"]
    assert exposed(0.02) == pytest.approx(one_pass - 0.02 * 3 / 4 + one_pass)
    assert exposed(1.0) == pytest.approx(one_pass / 4 + one_pass)
    assert cluster_step_time(p, 0.2, 100.0, 100.0, 1e-4, CommModel(after_passes=1))["comm_s"] == \
        pytest.approx(2 * one_pass)


def test_cluster_model_per_backend():
    """Which backends overlap, their bucket counts, hidden passes and idle fraction by design
    (BackendSpec.comm_model): 1 MB of fp32 parameters."""
    from dataclasses import asdict

    from psarch import registry

    def model(backend: dict, groups: int | None = None) -> dict:
        cfg = from_dict({"backend": {"world_size": 2, **backend}})
        extra = {"zero_groups": [groups, groups]} if groups is not None else {}
        return asdict(registry.spec_of(cfg).comm_model(cfg, 250_000, extra))

    one = {"hidden_passes": 0, "pipeline": 1, "idle_fraction": 0.0, "ready_share": 1.0,
           "after_passes": 0}
    assert model({"kind": "ddp", "bucket_cap_mb": 0.25}) == {"buckets": 4, "overlap": True, **one}
    assert model({"kind": "ddp", "overlap_comm": False})["overlap"] is False
    assert model({"kind": "torch_ddp", "bucket_cap_mb": 0.5}) == {"buckets": 2, "overlap": True, **one}
    # stages 1-2 all-gather the updated parameters after the optimizer step, as ZeroRedundancyOptimizer broadcasts
    assert model({"kind": "zero", "reduce_bucket_size": 125_000}) == {"buckets": 2, "overlap": True, **one,
                                                                       "after_passes": 1}
    assert model({"kind": "torch_zero", "bucket_cap_mb": 0.5})["after_passes"] == 1
    # stage 3 reduce-scatters one unit at a time: its groups, never reduce_bucket_size (stages 1-2 only)
    assert model({"kind": "zero", "stage": 3}, groups=5) == {"buckets": 5, "overlap": True, **one,
                                                             "hidden_passes": 2}
    assert model({"kind": "zero", "stage": 3})["buckets"] == 1
    # ps: 125,000 parameters a server in partitions of 65,536: 2 each, pushed from backward's hooks (not in GEO)
    ps = {"kind": "ps", "servers": 2, "partition_mb": 0.25, "partition_assignment": "ranges"}
    assert model(ps) == {"buckets": 4, "overlap": True, **one, "pipeline": pytest.approx(125_000 / 65_536),
                         "ready_share": 0.5}
    # dealt round robin (the default): 3 partitions of 65,536 and one of 53,392, server 0 the 1st and 3rd
    assert model(dict(ps, partition_assignment="round_robin")) == {"buckets": 4, "overlap": True, **one,
                                                                   "pipeline": 2.0, "ready_share": 1.0}
    # priority: modelled as without it (psarch/ps/spec.py's comm_model: measured no gain)
    assert model(dict(ps, priority_credit_mb=0.5)) == model(ps)
    assert model(dict(ps, mode="geo"))["overlap"] is False and model(dict(ps, partition_mb=0.0))["pipeline"] == 1
