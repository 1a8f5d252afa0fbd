"""ZeRO's books: model-state memory and bytes per step of every stage, exactly the ZeRO paper's formulas
(tests/test_zero.py runs the variants; the runs are shared through tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from collective.comm import ring_bytes
from psarch import theory
from zero.partition import Partition
from zero_runs import COMMS, OPTIMIZERS, STAGES


@pytest.fixture
def runs(zero_runs):
    return zero_runs


# ---- memory: the ZeRO formulas, exactly


def _counters(stage: int, opt: str, groups: int, precision: str) -> int:
    """AdamW keeps a 4-byte step counter per tensor it steps: in fp32 the model's own chunks, one per bucket
    (stages 1-2) or one shard (3); in bf16/fp16 the one flat fp32 master buffer of the rank's chunks."""
    return 0 if opt == "sgd" else 4 * (1 if stage == 3 or precision != "fp32" else groups)


def _check_memory(results: dict, name: str, stage: int, n: int, precision: str, opt: str) -> None:
    momentum = OPTIMIZERS["sgd"]["momentum"] if opt == "sgd" else 0.0
    b = theory.BYTES[precision]
    k = theory.optimizer_bytes_per_param(opt, precision, momentum)
    ranks = results[name]
    phi = ranks[0]["params"]
    padded, groups = ranks[0]["extra"]["zero_padded_params"], ranks[0]["extra"]["zero_groups"]
    assert padded % n == 0 and 0 <= padded - phi <= groups * (n - 1)
    # per rank: the formula with the padded count P, plus AdamW's step counters
    want = theory.memory_per_rank("zero", padded, n, precision, opt, momentum, stage=stage)
    for r in ranks.values():
        m = r["memory"]
        assert (m["params"], m["grads"], m["optimizer"] - _counters(stage, opt, groups, precision)) == \
            (want.params, want.grads, want.optimizer), (name, m, want)
    # padding, exactly: the full flat buffer's in every replicated category, the rank's own chunks' in the
    # sharded ones (padding sits at the end of each group, so the last ranks' chunks hold it)
    pad = padded - phi
    replicated = {1: 2 * b, 2: b, 3: 0}[stage]          # bytes per element held in full on every rank
    sharded = {1: 0, 2: b, 3: 2 * b}[stage] + k         # bytes per element split over the ranks
    part = Partition([[torch.empty(numel)] for numel in ranks[0]["extra"]["zero_group_numel"]], n)
    assert part.padded_numel == padded
    for rank, r in ranks.items():
        assert r["memory"]["padding"] == replicated * pad + sharded * part.shard_padding(rank), (name, rank)
    # over all ranks: with the padding taken out, exactly the formula in Φ (times N where replicated)
    assert sum(r["memory"]["padding"] for r in ranks.values()) == n * replicated * pad + sharded * pad
    total = sum(r["memory"]["total"] - r["memory"]["padding"] - _counters(stage, opt, groups, precision) for r in ranks.values())
    assert total == n * replicated * phi + sharded * phi


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [2, 3])
def test_memory_fp32_is_the_zero_formula(runs, opt, n):
    """fp32 AdamW (K = 8): stage 1 8Φ + 8Φ/N, stage 2 4Φ + 12Φ/N, stage 3 16Φ/N; SGD momentum K = 4."""
    _, results = runs
    for stage in STAGES:
        _check_memory(results, f"zero{stage}-ring-{opt}-{n}", stage, n, "fp32", opt)


@pytest.mark.parametrize("precision,n", [("bf16", 2), ("fp16", 2), ("bf16", 3)])
def test_memory_mixed_precision_adam_is_the_zero_formula(runs, precision, n):
    """Mixed precision AdamW (K = 12): stage 1 4Φ + 12Φ/N, stage 2 2Φ + 14Φ/N, stage 3 16Φ/N; at N = 3 the
    groups do not divide evenly, so the padding of every category is checked too."""
    _, results = runs
    for stage in STAGES:
        name = f"{precision}-{stage}" if n == 2 else f"{precision}-{stage}-n3"
        if n == 3:
            extra = results[name][0]["extra"]
            assert extra["zero_padded_params"] > results[name][0]["params"], "N = 3 run without padding"
        _check_memory(results, name, stage, n, precision, "adamw")


def test_stage3_gathered_units_are_working_memory(runs):
    """Stage 3 holds 1/N of the model for good; gathered units (and their gradient buffers) come and go:
    reported as working peak, at least root + one block, well under the whole model's params + grads."""
    _, results = runs
    for r in results["zero3-ring-adamw-2"].values():
        sizes = r["extra"]["zero_group_numel"]     # [root, block 0, block 1]
        working = r["memory"]["working"]
        assert 4 * (sizes[0] + max(sizes[1:])) <= working < 2 * 4 * r["params"], (working, sizes)


@pytest.mark.parametrize("name,n,prefetch_units", [("plain3", 2, 0), ("zero3-ring-adamw-2", 2, 1),
                                                   ("zero3-ring-adamw-3", 3, 1), ("bf16-3-n3", 3, 1)])
def test_stage3_gathered_peak_is_root_plus_units_in_use(runs, name, n, prefetch_units):
    """Gathered parameters, reported on their own: the root is held through forward and through backward,
    next to the unit in use and the units prefetched (prefetch_bucket_size 1500 elements: one 3280-element
    block; 0: none). So root + largest block <= gathered peak <= root + (1 + prefetch) x largest block,
    padded, in the compute dtype; with prefetch off a unit left gathered breaks the upper bound."""
    _, results = runs
    for r in results[name].values():
        b = 2 if name.startswith("bf16") else 4
        padded = [-(-k // n) * n * b for k in r["extra"]["zero_group_numel"]]   # [root, block 0, block 1]
        root, largest = padded[0], max(padded[1:])
        m = r["memory"]
        assert root + largest <= m["gathered_peak"] <= root + (1 + prefetch_units) * largest, (name, m, padded)
        # the root's gradient buffer lives through backward, next to the block's being accumulated
        assert root + largest <= m["grad_buffer_peak"], (name, m, padded)
        assert max(m["gathered_peak"], m["grad_buffer_peak"]) <= m["working"] <= m["gathered_peak"] + m["grad_buffer_peak"]


# ---- traffic: 2(N-1)/N and 3(N-1)/N of the padded bytes, exactly, on the ring


@pytest.mark.parametrize("n", [2, 3])
def test_traffic_per_step_is_the_zero_volume(runs, n):
    """Ring (measured) and native (modelled): per step reduce-scatter + all-gather = 2(N-1)/N·P·4 bytes
    (stages 1-2), all-gather twice + reduce-scatter = 3(N-1)/N·P·4 (stage 3), P the padded count: the
    formula in Φ plus at most N-1 padding elements per group."""
    _, results = runs
    for stage in STAGES:
        for comm in COMMS:
            for r in results[f"zero{stage}-{comm}-sgd-{n}"].values():
                assert r["traffic"]["modelled"] is (comm == "native")
                padded = r["extra"]["zero_padded_params"]
                factor = 3 if stage == 3 else 2
                exact = factor * (n - 1) * padded * 4 // n
                predicted = theory.traffic_per_step("zero", r["params"] * 4, n, stage=stage)["worker_sent"]
                assert predicted <= exact <= predicted + factor * (n - 1) * (padded - r["params"]) * 4 / n + 1
                for row in r["rows"]:
                    assert row["sent"] == row["received"] == exact, (stage, comm, row)
                ops = r["traffic"]["ops"]
                assert set(ops) == {"broadcast", "reduce_scatter", "all_gather", "export_all_gather"}
                # the export (fp32 masters, one all-gather per group) is booked apart from the steps' gathers
                groups, steps = r["extra"]["zero_groups"], len(r["rows"])
                assert ops["all_gather"]["calls"] == (2 if stage == 3 else 1) * steps * groups
                assert ops["export_all_gather"]["calls"] == groups
                assert ops["export_all_gather"]["sent"] == (n - 1) * padded * 4 // n


@pytest.mark.parametrize("precision,n", [("bf16", 2), ("fp16", 2), ("bf16", 3)])
def test_traffic_per_step_mixed_precision(runs, precision, n):
    """The wire carries the compute dtype, theory.BYTES[precision] per element. fp16 adds the global
    inf-flag all-reduce: one fp32 element, which the ring pads to N one-element chunks, so each rank sends
    (and receives) ring_bytes = 2(N-1)·4 bytes for it. A skipped fp16 step skips stages 1-2's all-gather."""
    _, results = runs
    b = theory.BYTES[precision]
    flag = ring_bytes("all_reduce", 1, 4, n)[0] if precision == "fp16" else 0
    assert flag == (2 * (n - 1) * 4 if precision == "fp16" else 0)
    for stage in STAGES:
        name = f"{precision}-{stage}" if n == 2 else f"{precision}-{stage}-n3"
        for r in results[name].values():
            padded = r["extra"]["zero_padded_params"]
            one_pass = (n - 1) * padded * b // n          # one reduce-scatter or one all-gather of everything
            predicted = theory.traffic_per_step("zero", r["params"] * b, n, stage=stage)["worker_sent"]
            assert predicted <= (3 if stage == 3 else 2) * one_pass <= predicted + 3 * (padded - r["params"]) * b
            for row in r["rows"]:
                gathers = 2 if stage == 3 else (0 if row["skipped"] else 1)
                exact = one_pass + gathers * one_pass + flag
                assert row["sent"] == row["received"] == exact, (name, row, exact)
            assert ("all_reduce" in r["traffic"]["ops"]) is (precision == "fp16")
