"""Schedules as data (collective/pipeline/schedule.py), checked without communication: the order each rank
runs, the idle slots counted from the instructions against the bubble formulas, the activations held; and
the cut of a model into stages (collective/pipeline/stage.py) on the meta device."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from collective.pipeline.schedule import (BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, SCHEDULES,
                                          Op, Pipe, bubble_fraction, compute_order, instructions, simulate)
from collective.pipeline.stage import Cut, split_blocks
from psarch.config import from_dict
from psarch.workload import build_workload

SHAPES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 6, 8, 16)]


def test_1f1b_order_is_warmup_then_one_forward_one_backward():
    F, B = (lambda i: Op(FORWARD, i)), (lambda i: Op(BACKWARD, i))
    assert compute_order("1f1b", Pipe(4, 6), 0) == [F(0), F(1), F(2), F(3), B(0), F(4), B(1), F(5), B(2), B(3),
                                                   B(4), B(5)]
    assert compute_order("1f1b", Pipe(4, 6), 3) == [x for i in range(6) for x in (F(i), B(i))]
    assert compute_order("gpipe", Pipe(2, 3), 1) == [F(0), F(1), F(2), B(0), B(1), B(2)]
    assert compute_order("naive", Pipe(2, 2), 0) == [F(0), B(0), F(1), B(1)]


def test_interleaved_runs_groups_of_p_micro_batches_per_chunk():
    order = compute_order("interleaved", Pipe(2, 4, 2), 1)
    forwards = [(op.mb, op.chunk) for op in order if op.kind == FORWARD]
    assert forwards == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    backwards = [(op.mb, op.chunk) for op in order if op.kind == BACKWARD]
    assert backwards == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    # rank 1 warms up with (p - rank - 1) x 2 + (v - 1) x p = 2 forwards
    assert [op.kind for op in order[:4]] == [FORWARD, FORWARD, FORWARD, BACKWARD]


def test_transfers_surround_the_compute():
    prog = instructions("1f1b", Pipe(3, 2), 1)
    assert prog[:3] == [Op(RECV_ACT, 0), Op(FORWARD, 0), Op(SEND_ACT, 0)]
    assert [op.kind for op in prog if op.mb == 0][3:] == [RECV_GRAD, BACKWARD, SEND_GRAD]
    first, last = instructions("gpipe", Pipe(3, 2), 0), instructions("gpipe", Pipe(3, 2), 2)
    assert RECV_ACT not in {op.kind for op in first} and SEND_GRAD not in {op.kind for op in first}
    assert SEND_ACT not in {op.kind for op in last} and RECV_GRAD not in {op.kind for op in last}
    # interleaved: rank 0's chunk 1 is virtual stage p, fed by rank p - 1's chunk 0
    inter = instructions("interleaved", Pipe(2, 2, 2), 0)
    assert Op(RECV_ACT, 0, 1) in inter and Op(RECV_ACT, 0, 0) not in inter


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("t_b", [1, 2])
def test_idle_slots_are_the_bubble_formula_exactly(schedule, t_b):
    """Every rank idles (p-1)/(m+p-1) of the step (naive (p-1)/p, interleaved (p-1)/(v·m+p-1)), counted
    from the instructions with a forward 1 slot and a backward t_b slots."""
    for p, m in SHAPES:
        for v in ((1, 2, 3) if schedule == "interleaved" else (1,)):
            if schedule == "interleaved" and m % p:
                continue
            pipe = Pipe(p, m, v)
            t = simulate(schedule, pipe, 1, t_b)
            want = {"naive": Fraction(p - 1, p), "interleaved": Fraction(p - 1, v * m + p - 1)}.get(
                schedule, Fraction(p - 1, m + p - 1))
            assert bubble_fraction(schedule, pipe) == want
            assert [t.idle_fraction(r) for r in range(p)] == [want] * p, (schedule, p, m, v)
            assert t.busy == [(1 + t_b) * v * m] * p


def test_activations_held():
    """GPipe holds every micro-batch; 1F1B never more than p (p - s at stage s); naive one."""
    for p, m in SHAPES:
        pipe = Pipe(p, m)
        assert simulate("gpipe", pipe).held_peak == [m] * p
        assert simulate("1f1b", pipe).held_peak == [min(m, p - s) for s in range(p)]
        assert max(simulate("1f1b", pipe).held_peak) <= p
        assert simulate("naive", pipe).held_peak == [1] * p


def test_bad_shapes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="microbatches = 3: the interleaved schedule takes micro-batches in "
                                         "groups of backend.stages = 2"):
        compute_order("interleaved", Pipe(2, 3, 2), 0)
    with pytest.raises(ValueError, match="allowed values are naive, gpipe, 1f1b, interleaved"):
        compute_order("zigzag", Pipe(2, 2), 0)
    with pytest.raises(ValueError, match="has 3 blocks .* fewer than the 4 virtual stages"):
        split_blocks(3, 4)


def test_blocks_split_evenly_and_the_root_goes_first_and_last():
    assert split_blocks(5, 2) == [range(0, 3), range(3, 5)]
    cfg = from_dict({"workload": {"model": "gpt", "seq_len": 8, "gpt": {"n_layer": 4, "n_embd": 16, "n_head": 2},
                                  "markov": {"vocab_size": 16}}})
    w = build_workload(cfg, device="meta")
    cut = Cut(w.model, "blocks", w.loss_fn, w.batch(0, 0, 1)[:2].to("meta"), 2, [1])
    assert list(cut.trace.pre) == ["embed", "pos"] and cut.trace.post == ["ln_f", "head"]
    assert cut.trace.block_inputs[1] == (torch.Size([2, 8, 16]), torch.float32)
    h = 16
    block = 2 * h + 3 * h * h + 3 * h + h * h + h + 2 * h + 4 * h * h + 4 * h + 4 * h * h + h   # norms, qkv, proj, MLP
    # stage 0: two blocks and the embeddings (16 tokens, 8 positions); stage 1: two blocks, ln_f and the head
    assert cut.stage_params() == [2 * block + 16 * h + 8 * h, 2 * block + 2 * h + h * 16]
    # rank 1 holds stage 1 only: blocks 2-3, the final norm and the head; the rest is dropped
    held = {n for n, p in w.model.named_parameters() if p.numel()}
    assert held == {n for n, _ in w.model.named_parameters() if n.startswith(("blocks.2", "blocks.3", "ln_f", "head"))}


def test_a_module_between_blocks_is_refused():
    """A Sequential's parameterless Tanh between two Linear units would run on no stage: refused, named."""
    from psarch.config import from_dict as load
    w = build_workload(load({"workload": {"factory": "factories:regression"}}))
    with pytest.raises(ValueError, match="module 'net.1' is called between blocks, so it would run on no stage"):
        Cut(w.model, "net", w.loss_fn, w.batch(0, 0, 1), 2, [0])
