"""The pipeline's and tensor parallelism's step programs (collective/pipeline/program.py,
collective/tensor/program.py): simulated in full and by their reduction they agree within 1% at every N from 2
to 32; with instant links the pipeline's step is schedule.simulate's makespan and its idle the bubble theory
gives; with no compute their steps are the bytes their theory counts over the link."""
from __future__ import annotations

import pytest

from collective.comm import ring_bytes
from collective.pipeline.program import pipeline_program
from collective.pipeline.schedule import Pipe, bubble_fraction, simulate as schedule_makespan
from collective.tensor.program import tensor_program
from psarch.theory.program import Cluster, DataStep, Transfer
from psarch.theory.simulate import simulate

RATE, ALPHA = 1e9, 2e-5
SCHEDULES = [("naive", Pipe(2, 3)), ("gpipe", Pipe(4, 8)), ("1f1b", Pipe(4, 8)), ("1f1b", Pipe(2, 4)),
             ("interleaved", Pipe(2, 4, 2))]


def pipe_program(schedule: str, pipe: Pipe, dp: int, reduced: bool):
    P = pipe.virtual
    return pipeline_program(schedule, pipe, dp, [1e-3] * P, [2e-3] * P, [2e5] * P, [3e6] * pipe.p, 1e-4, reduced)


@pytest.mark.parametrize("schedule,pipe", SCHEDULES)
def test_pipeline_full_and_reduced_agree_within_1_percent(schedule, pipe):
    for n in range(pipe.p, 33, pipe.p):
        dp = n // pipe.p
        full, reduced = pipe_program(schedule, pipe, dp, False), pipe_program(schedule, pipe, dp, True)
        a = simulate(full, Cluster.of(full, RATE, ALPHA)).step_s
        b = simulate(reduced, Cluster.of(reduced, RATE, ALPHA)).step_s
        assert b == pytest.approx(a, rel=0.01), f"{schedule} {pipe} at N = {n}: full {a:.6g} s, reduced {b:.6g} s"


@pytest.mark.parametrize("t,torch_loss", [(1, False), (2, False), (4, False), (4, True)])
def test_tensor_full_and_reduced_agree_within_1_percent(t, torch_loss):
    for n in range(t, 33, t):
        write = [tensor_program(t, n // t, 3, 1e6, 1e4, 4e6, DataStep.of(0.05), r, torch_loss) for r in (False, True)]
        a, b = (simulate(p, Cluster.of(p, RATE, ALPHA)).step_s for p in write)
        assert b == pytest.approx(a, rel=0.01), f"tensor t = {t} at N = {n}: full {a:.6g} s, reduced {b:.6g} s"


@pytest.mark.parametrize("schedule,pipe", SCHEDULES + [("interleaved", Pipe(4, 8, 2)), ("gpipe", Pipe(3, 1))])
def test_pipeline_step_is_the_schedules_makespan_and_its_idle_the_bubble(schedule, pipe):
    """Links that take no time (no bytes), forward 1 s and backward 2 s per micro-batch and stage."""
    P = pipe.virtual
    program = pipeline_program(schedule, pipe, 1, [1.0] * P, [2.0] * P, [0.0] * P, [0.0] * pipe.p)
    step = simulate(program, Cluster.of(program, RATE))
    assert step.step_s == pytest.approx(float(schedule_makespan(schedule, pipe, 1, 2).makespan))
    if schedule != "naive" or pipe.m == 1:   # naive: forward and backward alike give (p-1)/p only then
        assert step.idle_s / step.step_s == pytest.approx(float(bubble_fraction(schedule, pipe)))
    assert step.compute_s == pytest.approx(3.0 * pipe.m * pipe.v)


def test_pipeline_bytes_are_its_boundaries_and_its_stages_ring():
    """No compute, no latency, dp = 3: a stage rank sends m activations (or gradients) per boundary it sits at,
    and its ring all-reduce 2(dp-1)/dp of its gradients; one stage's all-reduce alone on its link takes that."""
    pipe, dp, act, grads = Pipe(4, 8), 3, 1e6, 6e6
    program = pipeline_program("1f1b", pipe, dp, [0.0] * 4, [0.0] * 4, [act] * 4, [grads] * 4)
    sent = [sum(op.bytes for op in program.ops if isinstance(op, Transfer) and op.src == node) for node in range(4)]
    ring = 2 * (dp - 1) / dp * grads
    assert sent == pytest.approx([pipe.m * act + ring, 2 * pipe.m * act + ring, 2 * pipe.m * act + ring,
                                  pipe.m * act + ring])
    only_ring = pipeline_program("1f1b", pipe, dp, [0.0] * 4, [0.0] * 4, [0.0] * 4, [grads] * 4)
    assert simulate(only_ring, Cluster.of(only_ring, RATE)).step_s == pytest.approx(ring / RATE)


def test_tensor_step_without_compute_is_its_bytes_over_the_link():
    """t = 4, dp = 2, L = 3, no compute, no latency: 4L + 2 all-reduces of the activation over t, the loss's
    all-gather, then the gradients' all-reduce over dp, one after another."""
    t, dp, layers, act, loss, grads = 4, 2, 3, 1e6, 1e4, 4e6
    program = tensor_program(t, dp, layers, act, loss, grads, DataStep(0.0, 0.0))
    expect = ((4 * layers + 2) * 2 * (t - 1) / t * act + (t - 1) * loss + 2 * (dp - 1) / dp * grads) / RATE
    assert simulate(program, Cluster.of(program, RATE)).step_s == pytest.approx(expect)


def test_specs_write_programs_whose_bytes_match_their_theory():
    """From a config: the tensor program with no compute moves what its theory's step_bytes count; the
    pipeline's stage ranks send what link_bytes counts but the loss's few bytes."""
    from collective.pipeline import theory as pipeline_theory
    from collective.tensor import theory as tensor_theory
    from psarch import registry
    from psarch.config import from_dict

    def gpt(kind: str, **backend):
        return from_dict({"workload": {"model": "gpt", "seq_len": 32, "markov": {"vocab_size": 64},
                                       "gpt": {"n_layer": 4, "n_embd": 32, "n_head": 4}},
                          "train": {"precision": "fp32", "optimizer": "adamw", "global_batch": 16},
                          "backend": {"kind": kind, "world_size": 8, **backend}})

    for kind in ("tensor", "torch_tensor"):   # torch's loss_parallel: three all-reduces in place of one gather
        cfg = gpt(kind, tensor_parallel=4)
        mine, whole = tensor_theory.held_params(cfg)
        program = registry.spec_of(cfg).program(cfg, whole, DataStep(0.0, 0.0))
        sent = sum(op.bytes for op in program.ops if isinstance(op, Transfer) and op.src == 0)
        assert sent == pytest.approx(tensor_theory.step_bytes(cfg, mine, kind == "torch_tensor")[0], rel=1e-3)

    cfg = gpt("pipeline", stages=4, microbatches=2)
    lay = pipeline_theory.layout(cfg)
    program = registry.spec_of(cfg).program(cfg, sum(lay.stage_params), DataStep(0.0, 0.0))
    for r in range(4):
        sent = sum(op.bytes for op in program.ops if isinstance(op, Transfer) and op.src == r)
        loss = ring_bytes("all_reduce", 1, pipeline_theory.LOSS_BYTES, 2)[0] + 3 * pipeline_theory.LOSS_BYTES \
            if r == 3 else 0
        assert sent == pytest.approx(pipeline_theory.link_bytes(cfg, lay, r).sent - loss, rel=1e-9)


@pytest.mark.parametrize("stages,schedule,layers", [(4, "1f1b", 4), (2, "interleaved", 5), (3, "gpipe", 7)])
def test_gpt_layout_from_the_shape_is_the_traced_cut(stages, schedule, layers):
    """gpt_layout (the GPT's shape alone, fast at 7.5B) finds the cut that tracing the model finds."""
    from collective.pipeline import theory as pipeline_theory
    from psarch.config import from_dict

    cfg = from_dict({"workload": {"model": "gpt", "seq_len": 16, "markov": {"vocab_size": 50},
                                  "gpt": {"n_layer": layers, "n_embd": 32, "n_head": 4}},
                     "train": {"global_batch": 24},
                     "backend": {"kind": "pipeline", "world_size": 2 * stages, "stages": stages, "microbatches": 4
                                 if schedule != "interleaved" else 2, "schedule": schedule}})
    assert pipeline_theory.gpt_layout(cfg) == pipeline_theory.layout(cfg)
