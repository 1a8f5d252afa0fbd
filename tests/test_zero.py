"""ZeRO parity: stages 1-3 end with the same model as `single`, DDP and PyTorch's peers.

Tolerance: as tests/test_ddp.py (fp32, rtol 1e-4 / atol 1e-5 on every parameter after 6 steps; AdamW
eps 1e-6): the runs differ only in the order per-sample gradients are summed. A missing or wrong
reduce-scatter, a stale all-gather or an optimizer stepping the wrong chunk moves parameters by about
one learning rate (1e-2), 1000x the tolerance. The model has Φ = 7232 parameters: not a multiple of 3, so
N = 3 pads; reduce_bucket_size = 600 gives stages 1-2 about a dozen buckets, each padded on its own.
Each world size runs every variant inside one spawned process group (start-up is the expensive part;
the runs themselves: tests/zero_runs.py). Memory and traffic against the formulas: test_zero_books.py.
"""
from __future__ import annotations

import ast
import inspect

import pytest
import torch

from parity import ATOL, assert_same_model, model
from psarch.config import from_dict
from psarch.workload import build_workload
from zero.partition import Partition, bucket_params
from zero.stage1 import Stage1
from zero.stage2 import Stage2
from zero.stage12 import MAX_IN_FLIGHT, Stage12
from psarch.model_units import find_units
from zero_runs import COMMS, STAGES, TINY_GPT


@pytest.fixture
def runs(zero_runs):
    """Every variant at N = 2 and 3, run once per session (tests/conftest.py): test_zero_books.py reads them too."""
    return zero_runs


# ---- unit tests of the partition arithmetic (no processes)


def test_partition_pads_each_group_to_equal_chunks():
    params = [torch.nn.Parameter(torch.zeros(k)) for k in (5, 3, 7, 1)]
    part = Partition(bucket_params(params, 8), 3)
    assert [[p.numel() for p in g.params] for g in part.groups] == [[5, 3], [7, 1]]
    assert [(g.numel, g.padded, g.chunk, g.flat_start, g.shard_start) for g in part.groups] == \
        [(8, 9, 3, 0, 0), (8, 9, 3, 9, 3)]
    assert part.padded_numel == 18 and part.shard_numel == 6 and part.padding == 2
    assert [part.shard_padding(r) for r in range(3)] == [0, 0, 2]   # padding sits in the last chunks
    flat = torch.arange(18.0)
    assert part.flat_chunk(part.groups[1], flat, 2).tolist() == [15.0, 16.0, 17.0]


def test_stage1_and_stage2_are_engines_of_their_own():
    """One idea per class: no stage 1-2 engine is told its stage or asks for it (the old shared engine
    branched on `self.stage` in eight places); what differs lives in each stage's own class."""
    for cls in (Stage12, Stage1, Stage2):
        tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
            {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
        assert "stage" not in names, f"{cls.__name__}'s module refers to a stage variable"
    assert issubclass(Stage1, Stage12) and issubclass(Stage2, Stage12)
    assert hasattr(Stage1, "_reduced") and Stage1._reduced is not Stage2._reduced


def test_units_are_the_blocks_plus_a_root():
    gpt = build_workload(from_dict(TINY_GPT)).model
    units = find_units(gpt)
    assert [u.name for u in units] == ["root", "blocks.0", "blocks.1"]
    assert {id(p) for u in units for p in u.params} == {id(p) for p in gpt.parameters()}
    assert [p.shape for p in units[0].params] == [gpt.embed.weight.shape, gpt.pos.weight.shape,
                                                  gpt.ln_f.weight.shape, gpt.ln_f.bias.shape, gpt.head.weight.shape]
    assert [u.name for u in find_units(gpt, "")] == ["root"]
    with pytest.raises(ValueError, match="no attribute 'layers'"):
        find_units(gpt, "layers")


def test_report_shows_padding_and_transient_peaks_where_present():
    from psarch.launch.outputs import report

    mem = {"rank": 0, "params": 10, "grads": 10, "optimizer": 40, "total": 60, "peak": None}
    summary = {"name": "z", "backend": "zero", "variant": "stage3/ring", "world_size": 2, "servers": 0,
               "workload": "gpt", "params": 20, "precision": "fp32", "optimizer": "adamw", "final_loss": 1.0,
               "skipped_steps": 0, "step_time_s": 0.01, "samples_per_s": 1.0,
               "predicted": {"memory_per_rank": {"total": 60}, "traffic_per_step": {"worker_sent": 1}},
               "memory": {"per_rank": [dict(mem, padding=4, gathered_peak=3000, grad_buffer_peak=2000, working=4000)]},
               "traffic": {"per_rank": [{"sent_per_step": 1}]}}
    head, row = report(summary).splitlines()[-2:]
    assert head.split()[6:10] == ["padding", "gathered", "grad", "bufs"] and "2.93 KiB" in row and "4 B" in row
    # each figure under its own column: padding, gathered, grad bufs, working
    assert row.split()[11:19] == ["4", "B", "2.93", "KiB", "1.95", "KiB", "3.91", "KiB"]
    summary["memory"]["per_rank"] = [mem]  # a backend without them: no empty columns
    assert "padding" not in report(summary) and "gathered" not in report(summary)


# ---- parity


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [2, 3])
def test_zero_equals_single_and_ddp(runs, opt, n):
    out, _ = runs
    ref = model(out, f"single-{opt}")
    init = build_workload(from_dict(TINY_GPT)).model.state_dict()
    assert max((ref[k] - v).abs().max().item() for k, v in init.items()) > 100 * ATOL, "reference barely trained"
    ddp = model(out, f"ddp-{opt}-{n}")
    for stage in STAGES:
        for comm in COMMS:
            mine = model(out, f"zero{stage}-{comm}-{opt}-{n}")
            assert_same_model(mine, ref, f"ZeRO-{stage} {comm} N={n} vs single")
            assert_same_model(mine, ddp, f"ZeRO-{stage} {comm} N={n} vs DDP")


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [2, 3])
def test_zero_equals_torch_peers(runs, opt, n):
    """Stage 1 = DDP + ZeroRedundancyOptimizer, stage 3 = FSDP2 fully_shard (per block, then root)."""
    out, _ = runs
    assert_same_model(model(out, f"zero1-ring-{opt}-{n}"), model(out, f"torch_zero-{opt}-{n}"),
                      f"ZeRO-1 N={n} vs ZeroRedundancyOptimizer")
    assert_same_model(model(out, f"zero3-ring-{opt}-{n}"), model(out, f"torch_fsdp-{opt}-{n}"),
                      f"ZeRO-3 N={n} vs FSDP2")


@pytest.mark.parametrize("stage", STAGES)
def test_overlapped_bucketed_prefetched_equals_plain(runs, stage):
    """Buckets reduced from hooks during backward / units prefetched == one bucket after backward, no
    prefetch. At N = 2 every sum has two terms, so the order cannot matter: the models are bitwise equal."""
    out, results = runs
    assert_same_model(model(out, f"zero{stage}-ring-adamw-2"), model(out, f"plain{stage}"),
                      f"ZeRO-{stage} fast vs plain", rtol=0, atol=0)
    fast, plain = results[f"zero{stage}-ring-adamw-2"][0]["extra"], results[f"plain{stage}"][0]["extra"]
    steps = TINY_GPT["train"]["steps"]
    # one bucket per unit, in reverse order: the root's head and final norm, block 1, block 0, the root's
    # embeddings (buckets never span two units)
    assert plain["zero_groups"] == (4 if stage < 3 else 3) and fast["zero_groups"] > (4 if stage < 3 else 2)
    # overlap: asynchronous reduce-scatters issued from autograd hooks while backward runs, one per group
    # and step, counted at the communicator; with overlap_comm = false none (stage 2 and 3 still reduce in
    # the hook, blocking)
    for rank in (0, 1):
        fast_rs = results[f"zero{stage}-ring-adamw-2"][rank]["probe"]["async_rs_in_backward"]
        plain_rs = results[f"plain{stage}"][rank]["probe"]["async_rs_in_backward"]
        assert (fast_rs, plain_rs) == (steps * fast["zero_groups"], 0), (stage, rank, fast_rs, plain_rs)
    assert fast["zero_reduced_in_backward"] == steps * fast["zero_groups"] and plain["zero_reduced_in_backward"] == 0
    if stage == 3:  # the next unit's gather started ahead of its use, forward and backward
        assert fast["zero_prefetched"] == steps * 2 * 2 and plain["zero_prefetched"] == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_activation_checkpointing_changes_memory_not_the_model(runs, stage):
    """Recomputing each unit in backward gives the same model, bitwise; the activations kept for backward
    (autograd's saved tensors + the inputs checkpointed units keep) shrink to a fraction."""
    out, results = runs
    assert_same_model(model(out, f"ckpt{stage}"), model(out, f"zero{stage}-ring-adamw-2"),
                      f"ZeRO-{stage} checkpointed vs not", rtol=0, atol=0)
    saved = results[f"zero{stage}-ring-adamw-2"][0]["rows"][-1]["saved_activation_bytes"]   # measured: asked for
    saved_ckpt = results[f"ckpt{stage}"][0]["rows"][-1]["saved_activation_bytes"]
    assert 0 < saved_ckpt < saved / 2, (saved_ckpt, saved)


@pytest.mark.parametrize("n", [2, 3])
def test_checkpoint_resumes_exactly(runs, n):
    """Parameters, optimizer and (fp16) loss-scaler state round-trip through a checkpoint at the same stage
    and world size: the resumed run is bitwise the same, in fp32, bf16 (N=2) and fp16."""
    _, results = runs
    for rank, res in results[f"resume-{n}"].items():
        assert len(res) == 3 * (3 if n == 2 else 2), res.keys()
        for variant, r in res.items():
            if rank == 0:
                assert r["diff"] == 0.0, (n, variant, r["diff"])
            before, after = r["scalers"]
            assert before == after, (n, variant, before, after)
            if variant.endswith("fp16"):  # a scaler reset on load would count 3 clean steps, not 6
                assert before["good_steps"] == 6, before


@pytest.mark.parametrize("n", [2, 3])
def test_saved_activations_are_measured_only_when_asked(runs, n):
    """The saved-activation meter hooks every tensor autograd saves: it runs only with
    backend.measure_activations (the ring AdamW runs), and nowhere else leaves a figure."""
    _, results = runs
    for stage in STAGES:
        for name in (f"zero{stage}-ring-adamw-{n}", f"zero{stage}-native-adamw-{n}", f"zero{stage}-ring-sgd-{n}"):
            asked = "ring-adamw" in name
            for r in results[name].values():
                assert ("saved_activation_bytes" in r["extra"]) is asked, (name, r["extra"])
                for row in r["rows"]:
                    assert (row["saved_activation_bytes"] is not None and row["saved_activation_bytes"] > 0) is asked


# ---- what each stage frees, seen from outside the engine (zero_runs.Probe)


def _stage_runs(results: dict, stage: int) -> list[str]:
    return [name for name, ranks in results.items()
            if isinstance(ranks.get(0), dict) and (ranks[0].get("probe") or {}).get("stage") == stage]


def test_stage2_drops_each_full_gradient_at_once(runs):
    """Right after its gradient hook no parameter keeps a .grad (the full gradient is never held), and
    the gradient buckets held at any hook (filling, or in flight: at most MAX_IN_FLIGHT) stay within
    (MAX_IN_FLIGHT + 1) buckets, well under the full gradient."""
    _, results = runs
    names = _stage_runs(results, 2)
    assert len(names) >= 10, names
    for name in names:
        for rank, r in results[name].items():
            probe, m = r["probe"], r["memory"]
            assert probe["grads_kept"] == 0, (name, rank, probe)
            item = m["params"] // r["extra"]["zero_padded_params"]     # the compute dtype's bytes
            n = len(results[name])
            largest = max(-(-k // n) * n for k in r["extra"]["zero_group_numel"]) * item
            assert 0 < probe["bucket_peak"] <= m["grad_buffer_peak"] <= (MAX_IN_FLIGHT + 1) * largest, (name, rank, probe, m)
            if r["extra"]["zero_groups"] > MAX_IN_FLIGHT + 1:
                assert m["grad_buffer_peak"] < m["params"], (name, m)


def test_stage3_keeps_only_its_parameter_slice(runs):
    """After every step each parameter's storage is empty (0 bytes: the rank keeps only its shard), and
    inside each module's backward its parameters are the full, gathered unit."""
    _, results = runs
    names = _stage_runs(results, 3)
    assert len(names) >= 10, names
    for name in names:
        for rank, r in results[name].items():
            probe = r["probe"]
            assert probe["held_after_step"] == 0, (name, rank, probe)
            assert probe["backward_checks"] > 0 and probe["backward_not_full"] == 0, (name, rank, probe)


def test_export_gathers_one_unit_at_a_time(runs):
    """full_state_dict all-gathers group by group and every group lies within one unit, so the largest
    buffer gathered is at most the largest unit's padded fp32 size, for every stage, even with a bucket
    size that would hold the whole model (plain: 10^6 elements); the model exported that way equals the
    reference, and is fp32 on the CPU whatever the compute dtype."""
    out, results = runs
    gpt = build_workload(from_dict(TINY_GPT)).model
    unit_numels = [sum(p.numel() for p in u.params) for u in find_units(gpt)]
    ref = model(out, "single-adamw")
    for stage in STAGES:
        for name, n in [(f"plain{stage}", 2)] + [(f"zero{stage}-{c}-adamw-{n}", n) for c in COMMS for n in (2, 3)]:
            bound = max(-(-k // n) * n for k in unit_numels) * 4
            for rank, r in results[name].items():
                peak = r["probe"]["export_gather_peak"]
                assert 0 < peak <= bound, (name, rank, peak, bound)
                if name.startswith("plain"):  # one bucket per unit: the largest unit is gathered whole
                    assert peak == bound, (name, peak, bound)
        assert_same_model(model(out, f"plain{stage}"), ref, f"ZeRO-{stage} one bucket per unit vs single")
        for t in model(out, f"bf16-{stage}").values():
            assert t.dtype == torch.float32 and t.device.type == "cpu"


# ---- mixed precision


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
def test_low_precision_converges(runs, precision, stage):
    _, results = runs
    for r in results[f"{precision}-{stage}"].values():
        losses = [x["loss"] for x in r["rows"]]
        assert losses[0] - losses[-1] > 1.0, f"{precision} ZeRO-{stage} did not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_overflow_skips_the_step_and_lowers_the_scale(runs, stage):
    """Each rank sees only its gradient chunk; the inf check is all-reduced, so every rank skips alike."""
    _, results = runs
    for r in results[f"overflow-{stage}"].values():
        assert [x["skipped"] for x in r["rows"]] == [False, False, False, True, True, False]
        assert [x["loss_scale"] for x in r["rows"]] == [2.0**16] * 4 + [2.0**15] * 2
