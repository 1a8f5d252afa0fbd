"""The programs a spec writes from a config (ddp, ZeRO, FSDP2, the PS and GEO, tensor parallelism, LoRA and frozen
parameters) time what their formulas say, with compute 0 and no latency; and a measured compute is taken apart
from the waits it holds."""
from __future__ import annotations

import math

import pytest

from psarch import registry
from psarch.config import from_dict
from psarch.theory.program import Cluster, DataStep, chunks
from psarch.theory.simulate import simulate
from test_step_programs import RATE
from zero.program import stage3_program


def test_specs_write_programs_whose_steps_match_the_formulas():
    """From a config, with compute 0 and no latency: the ring moves 2(N-1)/N S per rank, ZeRO-1 the same, ZeRO-3 and
    torch's ZeroRedundancyOptimizer under DDP 3(N-1)/N S, the PS with N dedicated servers S each way at once, pipelined
    over its 16 partitions per server (plus one slot's pull to drain, 1/16 of S), with one server N S through its link
    each way."""
    from psarch import registry, theory

    phi, n, net = 25e6, 8, DataStep(0.0, 0.0)
    s = phi * 4

    def step(kind: str, **backend) -> float:
        cfg = theory.config_for(kind, n, "fp32", "adamw", **backend)
        p = registry.spec_of(cfg).program(cfg, phi, net, True)
        return simulate(p, Cluster.of(p, RATE)).step_s

    assert step("ddp") == pytest.approx(2 * (n - 1) / n * s / RATE)
    assert step("zero", stage=1) == pytest.approx(2 * (n - 1) / n * s / RATE)
    assert step("zero", stage=3) == pytest.approx(3 * (n - 1) / n * s / RATE)
    assert step("torch_zero") == pytest.approx(3 * (n - 1) / n * s / RATE)   # DDP's all-reduce, the broadcasts
    part = s / n / 16      # a range in 16 (rounded down to 64 elements: server 0 gets a 17th, short, a little more)
    assert step("ps", servers=n, partition_mb=part / 2**20) == pytest.approx((s + s / 16) / RATE, rel=3e-3)
    assert step("ps", servers=1, partition_mb=s / 2**20) == pytest.approx(2 * n * s / RATE)


def test_fsdp_prefetch_hides_a_gather_behind_the_unit_before_and_keeps_the_root():
    """FSDP2's program (torch_fsdp): from a config, with compute 0 and no latency, its passes are forward's
    all-gather of S, backward's of S less the root (kept gathered) and the reduce-scatter of S; with compute, the
    prefetch of one unit makes the step shorter than ZeRO-3's gather-then-compute."""
    from psarch.theory import config_for
    from zero.theory import unit_shares

    n, phi = 4, 25e6
    cfg = config_for("torch_fsdp", n)
    root = unit_shares(cfg)[0]
    assert 0 < root < 1
    p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), False)
    s = 4 * phi
    assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx((3 - root) * (n - 1) / n * s / RATE)
    units = [s / 4] * 4
    slow = stage3_program(n, units, DataStep.of(0.2), False)
    fast = stage3_program(n, units, DataStep.of(0.2), False, prefetch=1)
    assert simulate(fast, Cluster.of(fast, RATE)).step_s < simulate(slow, Cluster.of(slow, RATE)).step_s - 0.05


@pytest.mark.parametrize("kind, options, holds", [("ddp", {}, False), ("zero", {"stage": 3}, True),
                                                  ("torch_fsdp", {}, True)])
def test_a_measured_compute_that_holds_blocking_passes_is_taken_apart_from_them(kind, options, holds):
    """cluster_step's compute from a measured step: where the trainer's measured compute holds waits for collectives
    (BackendSpec.compute_holds_waits) it is the compute that, played with the program, ends when the measured compute
    does; elsewhere the measured compute itself."""
    from psarch.theory import program_on_links, config_for, pure_compute
    from psarch.theory.simulate import play

    cfg = config_for(kind, 4, **options)   # 1 Gbit/s links: 4 MB in 3 passes, about 0.07 s of a 0.5 s compute
    assert registry.spec_of(cfg).compute_holds_waits(cfg) is holds
    phi, measured = 1e6, 0.5
    c = pure_compute(cfg, phi, measured, 1e-4)
    ops, _, end = play(*program_on_links(cfg, phi, c, None, 1e-4))
    last = max(end[k] for k, op in ops.items() if getattr(op, "seconds", 0) > 0)
    assert last == pytest.approx(measured, rel=1e-3)
    assert (c < measured - 0.01) is holds


def test_a_trainer_that_times_no_wait_gets_no_prediction_from_its_measured_step():
    """torch_fsdp times no wait apart (comm_s 0) on contended cores: its measured compute is the whole step, and a
    compute taken from it would predict the measured step by construction; cluster_step says nan instead. With its
    waits timed apart it is predicted."""
    from psarch.theory import cluster_step, config_for

    cfg = config_for("torch_fsdp", 4)
    whole = {"params": 1e6, "step_time_s": 0.5, "comm_s": 0.0, "cluster": {"alpha_s": 1e-4}}
    assert math.isnan(cluster_step(cfg, whole)["predicted_s"])
    apart = dict(whole, comm_s=0.05)
    assert cluster_step(cfg, apart)["predicted_s"] > 0.45


def test_geo_exchanges_once_in_k_steps_and_async_waits_for_no_round():
    """From a config with compute 0 and no latency: GEO's step is sync's exchange shared by its k steps; async
    answers each worker's pull once that worker's own push is in, never after a round, so no step of it is longer
    than sync's (with every worker alike, as long: the servers' links bind both)."""
    from psarch.theory import config_for

    phi, n = 25e6, 4

    def step(**backend) -> float:
        cfg = config_for("ps", n, "fp32", "sgd", servers=2, partition_mb=0.0, **backend)
        p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), True)
        return simulate(p, Cluster.of(p, RATE)).step_s

    assert step(mode="geo", k_steps=4) == pytest.approx(step(mode="sync") / 4)
    assert step(mode="async") <= step(mode="sync") * (1 + 1e-9)
    from psarch.theory.program import Transfer

    for mode in ("sync", "async"):
        cfg = config_for("ps", n, "fp32", "sgd", servers=2, server_placement="colocated", mode=mode)
        for reduced in (False, True):
            pulls = [op for op in registry.spec_of(cfg).program(cfg, phi, DataStep.of(0.1), reduced).ops
                     if isinstance(op, Transfer) and op.name.startswith("pull")]
            waits = {a.split(".")[0] for op in pulls for a in op.after}
            # async: the worker's own push (or, beside its own server, its own backward), never a round
            assert pulls and (waits == {"round"} if mode == "sync" else "round" not in waits and "push" in waits)


def test_ddps_program_takes_the_trainers_own_buckets():
    """ddp's trainer closes a bucket at a parameter's edge (collective/bucket.py's assign_buckets): its program
    all-reduces those buckets, not Φ cut at the cap, where the config's model holds Φ; a Φ asked about alone (the
    estimator's) is cut at the cap."""
    from collective.theory import ddp_bucket_shapes
    from psarch.theory.program import Transfer
    from psarch.workload import build_workload

    cfg = from_dict({"train": {"steps": 4}, "backend": {"kind": "ddp", "world_size": 4, "bucket_cap_mb": 0.05}})
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters())
    want = [4.0 * sum(math.prod(s) for s in bucket) for bucket in ddp_bucket_shapes(cfg)]

    def moved(p: float) -> list[float]:
        program = registry.spec_of(cfg).program(cfg, p, DataStep.of(0.1), True)
        return [op.bytes * 2 / 3 for op in program.ops if isinstance(op, Transfer)]   # 2(N-1)/N of each bucket

    assert moved(phi) == pytest.approx(want)
    assert moved(phi) != pytest.approx(chunks(4.0 * phi, 0.05 * 2**20))
    assert moved(phi + 1) == pytest.approx(chunks(4.0 * (phi + 1), 0.05 * 2**20))


def test_ddps_buckets_follow_the_lora_targets():
    """Adapters on blocks.0.mlp.0 or on blocks.0.mlp.2 train the same Φ in different shapes: each config gets its
    own trainer's buckets (ddp_bucket_shapes), not the other's from the cache."""
    from collective.theory import ddp_bucket_shapes, trainer_buckets
    from psarch.workload import build_workload

    def cfg_of(target: str):
        return from_dict({"train": {"steps": 4, "lora_rank": 2, "lora_targets": [target]},
                          "backend": {"kind": "ddp", "world_size": 4, "bucket_cap_mb": 1e-6}})

    cfgs = [cfg_of("blocks.0.mlp.0"), cfg_of("blocks.0.mlp.2")]
    phis = {sum(p.numel() for p in build_workload(c, device="meta").model.parameters() if p.requires_grad)
            for c in cfgs}
    assert len(phis) == 1
    phi = phis.pop()
    want = [[4.0 * sum(math.prod(s) for s in bucket) for bucket in ddp_bucket_shapes(c)] for c in cfgs]
    assert want[0] != want[1]
    assert [trainer_buckets(c, phi) for c in cfgs] == want


@pytest.mark.parametrize("kind", ["tensor", "torch_tensor"])
@pytest.mark.parametrize("train", [{"lora_rank": 4}, {"lora_rank": 2, "lora_alpha": 4.0},
                                   {"trainable": ["head.weight", "blocks.*.mlp.*"]}, {}])
def test_a_tensor_program_moves_theorys_bytes_with_lora_and_frozen_parameters(kind, train):
    """With compute 0 and no latency a tensor-parallel step is its bytes at the link's rate, predict()'s: the f's
    that nothing upstream needs are skipped and each adapter's rank-r all-reduce is in (tp_linears, one source)."""
    from psarch.theory import predict
    from psarch.workload import build_workload

    cfg = from_dict({"train": {"steps": 2, **train}, "backend": {"kind": kind, "world_size": 2}})
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters() if p.requires_grad)
    sent = predict(cfg, phi).per_rank[0].link.sent
    for reduced in (False, True):
        p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), reduced)
        assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(sent / RATE, rel=1e-9)


@pytest.mark.parametrize("train", [{"lora_rank": 2}, {"trainable": ["head.weight", "blocks.1.*"]}, {},
                                   {"trainable": ["head.weight", "blocks.0.*"]},
                                   {"lora_rank": 2, "lora_targets": ["blocks.1.*"]}])
@pytest.mark.parametrize("backend", [{"kind": "zero", "stage": 3}, {"kind": "torch_fsdp"}], ids=["zero3", "fsdp2"])
def test_a_zero3_program_gathers_the_frozen_weights_as_predict_counts(train, backend):
    """With compute 0 and no latency a ZeRO-3 step is its bytes at the link's rate, predict()'s: each unit's
    trainable parameters gathered twice and reduce-scattered, its frozen ones (padded to N as they are sharded)
    gathered twice and never reduced, once where backward never reaches the unit (block 0 where only block 1 and the
    head train, or LoRA adapts block 1 alone: nothing trains in it or before it); a block of frozen weights only
    reduces nothing. FSDP2's (torch_fsdp) gathers its root once, kept from forward through backward, and the frozen
    weights of a block backward does not reach where the block after it prefetches them."""
    from psarch.theory import predict
    from psarch.workload import build_workload

    cfg = from_dict({"train": {"steps": 2, "global_batch": 12, **train}, "workload": {"gpt": {"n_layer": 2}},
                     "backend": {**backend, "world_size": 3}})
    phi = sum(p.numel() for p in build_workload(cfg, device="meta").model.parameters() if p.requires_grad)
    sent = predict(cfg, phi).link.sent
    for reduced in (False, True):
        p = registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), reduced)
        assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(sent / RATE, rel=1e-3)
