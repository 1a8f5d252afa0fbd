"""Tensor parallelism's pure parts, no processes: the split of a GPT's parameters (every element held by exactly
one tensor-parallel rank, or by all where replicated), the shards as checkpoint fragments, the activation
formula against Korthikanti et al., the config rules and which data shard a rank trains on."""
from __future__ import annotations

import json

import pytest
import torch

from collective.tensor.layers import vocab_parallel_cross_entropy
from collective.tensor.mesh import TensorMesh, grid
from collective.tensor.split import shard_plan, vocab_range
from collective.tensor.state import local_layout
from collective.tensor.theory import gpt_shapes
from psarch import registry
from psarch.activations import block_activation_bytes
from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import PARAM, Pieces
from psarch.checkpoint.writer import merge, write_part
from psarch.config import ConfigError, from_dict

GPT = {"workload": {"model": "gpt", "seq_len": 8, "gpt": {"n_layer": 2, "n_embd": 16, "n_head": 4},
                    "markov": {"vocab_size": 10}}}


def shapes() -> dict[str, tuple[int, ...]]:
    return gpt_shapes(from_dict(GPT))


@pytest.mark.parametrize("t", [1, 2, 4])
def test_every_element_is_held_once_or_replicated(t):
    full = {n: torch.randn(s) for n, s in shapes().items()}
    for name, value in full.items():
        count = torch.zeros_like(value)
        rebuilt = torch.full_like(value, float("nan"))
        for r in range(t):
            shard = shard_plan(shapes(), t, r)[name]
            part = shard.take(value)
            assert tuple(part.shape) == shard.local_shape
            shard.put(rebuilt, part)
            shard.put(count, shard.take(count) + 1)
        replicated = shard_plan(shapes(), t, 0)[name].dim is None
        assert torch.equal(rebuilt, value), name
        assert torch.all(count == (t if replicated else 1)), name


def test_the_split_is_megatrons():
    """qkv: rank r's rows are q, k and v of its heads; proj and the MLP's second linear: columns; biases of
    row-parallel linears, LayerNorms and the position embedding whole; the vocabulary as even as it goes."""
    plan = shard_plan(shapes(), 2, 1)
    assert plan["blocks.0.attn.qkv.weight"].ranges == ((8, 16), (24, 32), (40, 48))
    assert plan["blocks.0.attn.qkv.bias"].ranges == ((8, 16), (24, 32), (40, 48))
    assert (plan["blocks.1.attn.proj.weight"].dim, plan["blocks.1.attn.proj.weight"].ranges) == (1, ((8, 16),))
    assert (plan["blocks.1.mlp.0.weight"].dim, plan["blocks.1.mlp.0.weight"].ranges) == (0, ((32, 64),))
    assert (plan["blocks.1.mlp.2.weight"].dim, plan["blocks.1.mlp.2.weight"].ranges) == (1, ((32, 64),))
    whole = [n for n, s in plan.items() if s.dim is None]
    assert whole == ["pos.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.0.attn.proj.bias",
                     "blocks.0.ln2.weight", "blocks.0.ln2.bias", "blocks.0.mlp.2.bias", "blocks.1.ln1.weight",
                     "blocks.1.ln1.bias", "blocks.1.attn.proj.bias", "blocks.1.ln2.weight", "blocks.1.ln2.bias",
                     "blocks.1.mlp.2.bias", "ln_f.weight", "ln_f.bias"]
    assert [vocab_range(10, 4, r) for r in range(4)] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert plan["embed.weight"].ranges == plan["head.weight"].ranges == ((5, 10),)


def test_shards_written_as_fragments_read_back_as_the_full_model(tmp_path):
    """Each of t = 4 ranks writes its parts (qkv as three row ranges, row-parallel weights as column blocks) with
    an optimizer state beside them; the checkpoint reads back every full parameter, and fills another split."""
    full = {n: torch.randn(s) for n, s in shapes().items()}
    names = []
    for r in range(4):
        plan = shard_plan(shapes(), 4, r)
        flat = torch.cat([plan[n].take(full[n]).reshape(-1) for n in plan])
        frags = []
        for name, at, numel in local_layout(plan):
            piece = flat[at:at + numel]
            frags += plan[name].fragments({PARAM: piece, "exp_avg": 2 * piece}, {"step": 3.0})
        if r:   # replicated parameters: written once
            frags = [f for f in frags if plan[f.name].dim is not None]
        write_part(Pieces(frags, shapes()), tmp_path, f"rank{r}")
        names.append(f"rank{r}")
    merge(tmp_path, names, 3, {}, shapes(), {}, len(names))
    ckpt = Checkpoint(tmp_path)
    ckpt.verify()
    assert any("columns" in e for e in ckpt.meta["fragments"])
    for name, value in full.items():
        assert torch.equal(ckpt.read(name, PARAM, 0, value.numel()), value.view(-1)), name
        assert torch.equal(ckpt.read(name, "exp_avg", 0, value.numel()), 2 * value.view(-1)), name
    plan = shard_plan(shapes(), 2, 1)   # a t = 2 rank fills its parts from the t = 4 checkpoint
    for name, shard in plan.items():
        got = torch.empty(shard.local_shape)
        for f in shard.fragments({PARAM: got.view(-1)}, {}):
            ckpt.fill(f)
        assert torch.equal(got, shard.take(full[name])), name
    ckpt.close()


def test_vocab_parallel_cross_entropy_alone_is_torchs():
    """One rank holding the whole vocabulary: the same loss and gradient as F.cross_entropy."""
    logits = torch.randn(6, 10, requires_grad=True)
    target = torch.randint(0, 10, (6,))
    mine = vocab_parallel_cross_entropy(logits, target, 0, TensorMesh(0, 1, 0, 1))
    (grad,) = torch.autograd.grad(mine, logits)
    ref = torch.nn.functional.cross_entropy(logits, target)
    torch.testing.assert_close(mine, ref)
    torch.testing.assert_close(grad, torch.autograd.grad(ref, logits)[0])


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_block_activations_against_korthikanti(t):
    """At 2 bytes a value, s·b·h·(8 + 24/t) plus the LayerNorms' statistics and the attention's logsumexp:
    the paper's s·b·h·(10 + 24/t + 5as/(ht)) less the two dropout masks (2·s·b·h) and less the attention
    matrices that fused attention recomputes (5·a·s²·b/t), plus 4 fp32 bytes per head, token and sequence."""
    s, b, h, a = 128, 4, 256, 8
    paper = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    ours = block_activation_bytes(s, b, h, a, 2, t)
    assert ours == pytest.approx(paper - 2 * s * b * h - 5 * a * s * s * b / t + 2 * 2 * 2 * s * b + 4 * a * s * b / t)
    assert block_activation_bytes(s, b, h, a, 4, t) == pytest.approx(
        4 * s * b * h * (4 + 12 / t) + 4 * 4 * s * b + 4 * a * s * b / t)


def config(**backend) -> dict:
    return {**json.loads(json.dumps(GPT)), "train": {"global_batch": 4}, "backend": {"kind": "tensor", **backend}}


@pytest.mark.parametrize("change, says", [
    ({"workload": {"model": "mlp"}}, 'workload.model = "mlp": backend.kind = "tensor" splits the built-in GPT'),
    ({"workload": {"factory": "factories:regression"}}, 'workload.factory = "factories:regression": backend.kind'),
    ({"backend": {"world_size": 4, "tensor_parallel": 3}}, "backend.tensor_parallel = 3: must divide "
                                                          "backend.world_size = 4"),
    ({"backend": {"world_size": 8, "tensor_parallel": 8}}, "must divide workload.gpt.n_head = 4"),
    ({"backend": {"world_size": 4}, "workload": {"markov": {"vocab_size": 3, "branching": 2}}},
     "needs at least 4 tokens"),
    ({"train": {"precision": "fp16"}}, 'train.precision = "fp16": backend.kind = "tensor" runs fp32 or bf16'),
    ({"backend": {"world_size": 6, "tensor_parallel": 2}, "train": {"global_batch": 4}},
     'must be divisible by the 3 shards of the global batch that backend.kind = "tensor" reads'),
])
def test_config_errors_name_what_is_supported(change, says):
    data = config(world_size=2)
    for section, values in change.items():
        for k, v in values.items():
            if isinstance(v, dict):
                data.setdefault(section, {}).setdefault(k, {}).update(v)
            else:
                data.setdefault(section, {})[k] = v
    with pytest.raises(ConfigError) as e:
        from_dict(data)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_ranks_of_a_tensor_group_share_a_batch_shard():
    cfg = from_dict(config(world_size=8, tensor_parallel=2))
    spec = registry.spec_of(cfg)
    assert [spec.batch_shard(cfg, r, 8) for r in range(8)] == [(r // 2, 4) for r in range(8)]
    assert [grid(r, 8, 2) for r in range(8)] == [(r // 2, r % 2) for r in range(8)]
    assert (cfg.backend.tp_size, cfg.backend.dp_size) == (2, 4)
    pure = from_dict(config(world_size=4))   # tensor_parallel = 0: every rank in one tensor-parallel group
    assert (pure.backend.tp_size, pure.backend.dp_size, registry.spec_of(pure).batch_shard(pure, 3, 4)) == (4, 1, (0, 1))
    ddp = from_dict({"backend": {"kind": "ddp", "world_size": 4}})
    assert registry.spec_of(ddp).batch_shard(ddp, 3, 4) == (3, 4)


@pytest.mark.parametrize("dtype, width", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_a_whole_blocks_activations_equal_the_formula_at_t1(dtype, width):
    """The plain GPT (t = 1, no split): what autograd keeps inside its blocks, measured from the tensors, is
    block_activation_bytes(t = 1) per block, byte for byte."""
    from psarch.meters import SavedActivationMeter
    from psarch.models.gpt import GPT as Model

    torch.manual_seed(0)
    model = Model(32, 16, n_layer=3, n_embd=24, n_head=3).to(dtype)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    meter = SavedActivationMeter(lambda: storages, scope=list(model.blocks))
    with meter:
        model(torch.randint(0, 32, (5, 16))).float().sum().backward()
    assert meter.bytes == 3 * block_activation_bytes(16, 5, 24, 3, width)
