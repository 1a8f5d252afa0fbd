"""Pipeline theory (collective/pipeline/theory.py) and the activation formula (psarch/activations.py) against
formulas written out here, and against the bytes autograd keeps for one GPT block; the pipeline's config
rules, one line each."""
from __future__ import annotations

import pytest
import torch

from psarch import registry, theory
from psarch.activations import block_activation_bytes
from psarch.config import ConfigError, from_dict
from psarch.models.gpt import Block
from psarch.meters import SavedActivationMeter

GPT = {"model": "gpt", "seq_len": 8, "gpt": {"n_layer": 4, "n_embd": 16, "n_head": 2}, "markov": {"vocab_size": 16}}


def cfg(**backend):
    train = {"global_batch": 16, "optimizer": backend.pop("optimizer", "adamw"),
             "precision": backend.pop("precision", "fp32")}
    return from_dict({"workload": GPT, "train": train,
                      "backend": {"kind": "pipeline", "world_size": 2, "stages": 2, **backend}})


def test_block_activations_written_out():
    """16 values per token and hidden unit (4 whole, 12 split by t), norms' statistics (2 x 2 x B per token),
    the attention's fp32 log-sum-exp (4 bytes per head and token, split by t)."""
    s, b, h, a = 128, 4, 256, 8
    assert block_activation_bytes(s, b, h, a, 2) == s * b * h * 16 * 2 + s * b * (8 + 4 * a)
    assert block_activation_bytes(s, b, h, a, 2, tensor_parallel=4) == s * b * h * (4 + 12 / 4) * 2 + \
        s * b * (8 + 4 * a / 4)
    # the paper's 34·s·b·h + 5·a·s²·b (2-byte values) less its two 1-byte dropout masks and its unfused
    # attention's 5·a·s²·b is our 32·s·b·h at B = 2, statistics aside
    paper = 34 * s * b * h + 5 * a * s * s * b
    assert paper - 2 * s * b * h - 5 * a * s * s * b == s * b * h * 16 * 2
    # Megatron's t-way: sbh(10 + 24/t) less the masks (2 bytes) = 2 bytes x (4 + 12/t) values
    t = 8
    assert s * b * h * (10 + 24 / t) - 2 * s * b * h == s * b * h * (4 + 12 / t) * 2


@pytest.mark.parametrize("dtype,width", [(torch.float32, 4), (torch.bfloat16, 2)])
@pytest.mark.parametrize("b,s,h,a", [(2, 8, 16, 2), (4, 32, 64, 4), (1, 64, 128, 8)])
def test_block_activations_are_what_autograd_keeps(dtype, width, b, s, h, a):
    torch.manual_seed(0)
    block = Block(h, a, 4).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    with SavedActivationMeter(lambda: params) as meter:
        block(x)
    assert meter.bytes == block_activation_bytes(s, b, h, a, width)


def test_bad_arguments_are_one_line():
    with pytest.raises(ValueError, match="heads = 0, expected an integer >= 1"):
        block_activation_bytes(8, 1, 16, 0, 4)
    with pytest.raises(ValueError, match="tensor_parallel = 3 must divide heads = 4"):
        block_activation_bytes(8, 1, 16, 4, 4, tensor_parallel=3)


def test_memory_is_each_stages_own_units():
    h = 16
    block = 12 * h * h + 13 * h
    own = [2 * block + 16 * h + 8 * h, 2 * block + 2 * h + 16 * h]   # embeddings first; ln_f and head last
    p = theory.predict(cfg(), 1)
    assert [r["stage_params"] for r in p.to_dict()["per_rank"]] == own
    assert [r.memory.total for r in p.per_rank] == [(4 + 4 + 8) * x for x in own]
    assert p.memory_per_rank.total == (4 + 4 + 8) * max(own)
    bf16 = theory.predict(cfg(precision="bf16", optimizer="sgd"), 1).per_rank[0].memory
    assert (bf16.params, bf16.grads, bf16.optimizer) == (2 * own[0], 2 * own[0], 4 * own[0])


def test_bubble_and_activations_held_follow_the_schedule():
    b, s, h = 16 // 4, 8, 16
    blocks = 2 * block_activation_bytes(s, b, h, 2, 4)
    for schedule, held in (("gpipe", [4, 4]), ("1f1b", [2, 1])):
        per_rank = theory.predict(cfg(schedule=schedule, microbatches=4), 1).to_dict()["per_rank"]
        assert [r["idle_fraction"] for r in per_rank] == [1 / 5, 1 / 5]
        first = blocks + 8 * b * (s + 1) + 8 * s          # + the tokens and positions the embeddings index by
        # + ln_f's input and statistics, the head's input, log-softmax, targets, the loss's total weight
        last = blocks + s * b * (2 * h * 4 + 2 * 4 + 4 * 16 + 8) + 4
        assert [r["activations_held"] for r in per_rank] == [held[0] * first, held[1] * last]
    inter = theory.predict(cfg(schedule="interleaved", virtual_stages=2, microbatches=4), 1).to_dict()["per_rank"]
    assert inter[0]["idle_fraction"] == pytest.approx(1 / (2 * 4 + 1))


def test_dp_adds_the_ring_all_reduce_of_each_stage():
    """dp = 2: micro-batches of 16 / (2 x 4) = 2 sequences; each stage's gradients ring all-reduced over its two
    replicas (2 chunks of ceil(params / 2), 4 bytes); the last stage all-reduces its fp64 loss the same way and
    sends it (8 bytes) to the first."""
    two = theory.predict(cfg(world_size=4), 1).per_rank
    assert len(two) == 4 and two[2].link == two[0].link and two[3].link == two[1].link
    act = 4 * 2 * 8 * 16 * 4                                   # m x b x s x h x 4 bytes, one way
    for r in range(2):
        own = two[r].figures["stage_params"]
        ring = 2 * (2 - 1) * -(-own // 2) * 4
        loss_sent, loss_received = (2 * 8 + 8, 2 * 8) if r == 1 else (0, 8)
        assert (two[r].link.sent, two[r].link.received) == (act + ring + loss_sent, act + ring + loss_received)


@pytest.mark.parametrize("backend,says", [
    ({"stages": 3}, "backend.stages = 3: must divide backend.world_size = 2"),
    ({"microbatches": 3}, "backend.microbatches = 3: train.global_batch = 16 must split into 1 pipeline"),
    ({"stages": 2, "schedule": "interleaved", "virtual_stages": 4},
     "backend.stages = 2: the model has 4 blocks .* every one of the 8 stages"),
    ({"schedule": "interleaved", "microbatches": 1}, "the interleaved schedule takes micro-batches in groups of"),
    ({"precision": "fp16"}, "train.precision = \"fp16\": backend.kind = \"pipeline\" runs fp32 or bf16 only"),
])
def test_config_mistakes_are_one_line(backend, says):
    with pytest.raises(ConfigError, match=says):
        cfg(**backend)


def test_stragglers_are_refused():
    with pytest.raises(ConfigError, match="cluster.jitter: stragglers slow a worker's whole loss_fn"):
        from_dict({"workload": GPT, "train": {"global_batch": 16}, "cluster": {"jitter": 0.1},
                   "backend": {"kind": "pipeline", "world_size": 2}})


def test_the_batch_is_cut_in_pipelines_not_ranks():
    """The core asks the backend how many shards its ranks read (BackendSpec.batch_shard): 4 stages of one
    pipeline read one shard, so a global batch of 6 fits 4 ranks (2 micro-batches of 3)."""
    c = from_dict(
        {"workload": GPT, "train": {"global_batch": 6},
         "backend": {"kind": "pipeline", "world_size": 4, "stages": 4, "microbatches": 2}})
    assert [registry.spec_of(c).batch_shard(c, r, 4) for r in range(4)] == [(0, 1)] * 4
    with pytest.raises(ConfigError, match="global_batch = 6: must be divisible by backend.world_size = 4"):
        from_dict({"workload": GPT, "train": {"global_batch": 6}, "backend": {"kind": "ddp", "world_size": 4}})


def test_the_torch_peer_predicts_what_pipeline_predicts():
    """torch_pipeline runs the same stages and schedules: the same theory (its traffic is this, modelled)."""
    c = cfg(schedule="gpipe")
    peer = from_dict({**c.to_dict(), "backend": {"kind": "torch_pipeline", "world_size": 2, "stages": 2,
                                                 "schedule": "gpipe"}})
    assert theory.predict(peer, 1).to_dict() == theory.predict(c, 1).to_dict()
    with pytest.raises(ConfigError, match="torch.distributed.pipelining has no naive schedule"):
        from_dict({**c.to_dict(), "backend": {"kind": "torch_pipeline", "world_size": 2, "schedule": "naive"}})


def test_cluster_step_time_is_the_simulated_schedule():
    """On a cluster: the pipeline's step program (collective/pipeline/program.py) played on the run's links, each
    rank computing the measured compute (step less the waits): never under the compute stretched by the bubble,
    1/(1 - bubble), and here within 1% of it (a small model: its stages a little uneven, the transfers short)."""
    c = from_dict({"workload": GPT, "train": {"global_batch": 16},
                   "backend": {"kind": "pipeline", "world_size": 2, "schedule": "gpipe", "microbatches": 4},
                   "cluster": {"link_mbps": 100.0}})
    summary = {"step_time_s": 0.5, "comm_s": 0.1, "params": 1, "cluster": {"alpha_s": 0.0}}
    got = theory.cluster_step(c, summary)["predicted_s"]
    assert got == pytest.approx(theory.simulated_step(c, 1, 0.4, None, 0.0).step_s)
    assert 0.4 / (1 - 1 / 5) <= got <= 1.01 * 0.4 / (1 - 1 / 5)
