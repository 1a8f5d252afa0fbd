"""LoRA and frozen parameters on the model-parallel backends and the peers (tests/test_lora.py covers ddp, zero, ps,
dp): pipeline (p = 2 at N = 2, LoRA and a frozen set, and dp 2 x p 2 at N = 4), torch_pipeline, tensor (t = 2, LoRA and
a frozen set), torch_tensor, torch_fsdp, and the hybrid (ddp with embeddings = "ps" on dlrm) each end with `single`'s
model when both train the same adapters (SGD, within parity.SGD_ATOL = 1e-5 absolute on every parameter); frozen weights
never move; bytes per step are the backend's formula for the parameters that train (measured where psarch counts them:
pipeline and tensor, exactly; modelled for torch's peers, FSDP2's all-gathers carrying the frozen weights too); memory
reports the frozen weights a rank keeps apart, equal to theory's (a pipeline stage keeps its own, a tensor rank its
parts, FSDP2 its shard of each: they are sharded with their unit, as psarch's ZeRO-3 shards them). Fine-tuning from a base model's
checkpoint equals `single`'s fine-tune on each of these backends (the hybrid's: tests/test_hybrid_lora_from.py)."""
from __future__ import annotations

import pytest
import torch

from collective.tensor.theory import tp_all_reduces
from parity import OPTIMIZERS, SGD_ATOL, assert_same_model, config
from psarch.config import ConfigError, from_dict, load_config
from psarch.launch.ranks import run
from psarch.workload import build_workload
from test_ps_rows import ROWS_DLRM

LORA = dict(OPTIMIZERS["sgd"], lora_rank=2, lora_alpha=4.0)
HEAD_AND_MLP = dict(OPTIMIZERS["sgd"], trainable=["head.weight", "blocks.*.mlp.*"])
GPT2 = {"gpt": {"n_layer": 2, "n_embd": 16, "n_head": 2}}   # two blocks: one per pipeline stage
DLRM_LORA = dict(OPTIMIZERS["sgd"], lr=0.5, momentum=0.0, weight_decay=0.0, lora_rank=2, lora_alpha=4.0,
                 trainable=["tables.*"])   # the hybrid's tables train on the PS servers
PIPE = {"kind": "pipeline", "microbatches": 2}
# name -> (train, backend, its reference): every run at N = 2 but pipeline-dp2 (N = 4)
RUNS = {
    "pipeline": (LORA, dict(PIPE, world_size=2), "single"),
    "pipeline-dp2": (LORA, dict(PIPE, world_size=4, stages=2), "single"),
    "pipeline-frozen": (HEAD_AND_MLP, dict(PIPE, world_size=2), "single-frozen"),
    "torch_pipeline": (LORA, dict(PIPE, kind="torch_pipeline", world_size=2), "single"),
    "tensor": (LORA, {"kind": "tensor", "world_size": 2}, "single"),
    "tensor-frozen": (HEAD_AND_MLP, {"kind": "tensor", "world_size": 2}, "single-frozen"),
    "torch_tensor": (LORA, {"kind": "torch_tensor", "world_size": 2}, "single"),
    "torch_fsdp": (LORA, {"kind": "torch_fsdp", "world_size": 2}, "single"),
}
HYBRID = {"kind": "ddp", "embeddings": "ps", "servers": 2, "world_size": 2}


def _config(name: str, train: dict, backend: dict):
    return from_dict(config(name, train=train, backend=backend, workload=GPT2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lorabackends")
    s = {"single": run(_config("single", LORA, {"kind": "single"}), out / "single", echo=False),
         "single-frozen": run(_config("single-frozen", HEAD_AND_MLP, {"kind": "single"}), out / "single-frozen",
                              echo=False)}
    for name, (train, backend, _) in RUNS.items():
        s[name] = run(_config(name, train, backend), out / name, echo=False)
    for name, backend in (("single-dlrm", {"kind": "single"}), ("hybrid", HYBRID)):
        s[name] = run(from_dict(config(name, base=ROWS_DLRM, train=DLRM_LORA, backend=backend)), out / name,
                      echo=False)
    return out, s


def _model(out, name):
    return torch.load(out / name / "model.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*RUNS, "hybrid"])
def test_equals_single_training_the_same_parameters(runs, name):
    out, _ = runs
    ref = "single-dlrm" if name == "hybrid" else RUNS[name][2]
    assert_same_model(_model(out, name), _model(out, ref), f"{name} vs {ref}", rtol=0, atol=SGD_ATOL)
    if name == "hybrid":
        initial = build_workload(from_dict(config("x", base=ROWS_DLRM, train=DLRM_LORA))).model.state_dict()
        frozen = {k for k in initial if not k.endswith(("lora_A", "lora_B")) and not k.startswith("tables.")}
    else:
        train = RUNS[name][0]
        initial = build_workload(_config("x", train, {"kind": "single"})).model.state_dict()
        trains = {n for n, p in build_workload(_config("x", train, {"kind": "single"})).model.named_parameters()
                  if p.requires_grad}
        frozen = set(initial) - trains
    trained = _model(out, name)
    assert frozen and all(torch.equal(trained[k], initial[k]) for k in frozen)   # the frozen weights never move
    assert any(not torch.equal(trained[k], initial[k]) for k in set(initial) - frozen)   # what trains does


@pytest.mark.slow
def test_only_the_trainable_parameters_move(runs):
    """Measured bytes equal theory's per rank on pipeline and tensor, whose formulas take Φ, the parameters that train:
    a stage's dp all-reduce of its own trainable parameters (pipeline-dp2); tensor's dp-free step its activations'
    all-reduces (2L + 1 g's forward, the f's backward where something before them trains, one b·s·r all-reduce per
    adapter) and the loss's all-gather. torch's peers are modelled: FSDP's 3 ring passes over 4Φ and 2 (its
    all-gathers) over the frozen weights' 4F, less backward's all-gather of its root (Φ_root trainable, F_root
    frozen), which FSDP2 keeps gathered from forward through backward."""
    from zero.theory import unit_sizes

    _, s = runs
    for name in RUNS:
        phi, frozen = s[name]["params"], s[name]["frozen_params"]
        assert phi > 0 and frozen > 0
        predicted = s[name]["predicted"]
        for r, t in enumerate(s[name]["traffic"]["per_rank"]):
            if name == "torch_fsdp":
                root, root_frozen = unit_sizes(_config(name, *RUNS[name][:2]))[0]
                assert t["sent_per_step"] == (2 - 1) / 2 * 4 * (3 * phi - root + 2 * frozen - root_frozen)
                assert t["sent_per_step"] == predicted["traffic_per_step"]["worker_sent"]
            else:
                assert t["sent_per_step"] == predicted["per_rank"][r]["sent"], (name, r)
        if name.startswith(("pipeline", "torch_pipeline")):
            stages = predicted["per_rank"][:2]
            assert sum(x["stage_params"] for x in stages) == phi
    L = GPT2["gpt"]["n_layer"]
    # LoRA: every linear adapted, the first qkv's f skipped (nothing before it trains); the frozen set: the
    # f's of the first block skipped, no adapter
    assert tp_all_reduces(_config("x", LORA, {"kind": "tensor", "world_size": 2})) == (4 * L + 1, 4 * L + 1)
    assert tp_all_reduces(_config("x", HEAD_AND_MLP, {"kind": "tensor", "world_size": 2})) == (2 * L + 1 + 3, 0)


@pytest.mark.slow
def test_memory_reports_frozen_weights_apart(runs):
    """Memory's frozen category per rank equals theory's: a pipeline stage's own frozen weights, a tensor rank's
    parts of them, FSDP2's shard of each (ceil(d0 / N) rows: half at N = 2, every first dimension even here); what
    trains, by the formulas for Φ."""
    _, s = runs
    for name in RUNS:
        predicted = s[name]["predicted"]
        frozen_bytes = 4 * s[name]["frozen_params"]
        for r, m in enumerate(s[name]["memory"]["per_rank"]):
            p = predicted["per_rank"][r]["memory"] if "per_rank" in predicted else predicted["memory_per_rank"]
            assert (m["params"], m["grads"], m["optimizer"], m["frozen"]) == \
                (p["params"], p["grads"], p["optimizer"], p["frozen"]), (name, r)
            if name == "torch_fsdp":
                assert m["frozen"] == frozen_bytes // 2
            elif name.startswith(("pipeline", "torch_pipeline", "tensor", "torch_tensor")):
                assert 0 < m["frozen"] < frozen_bytes   # a part of the frozen weights, not all
            else:
                assert m["frozen"] == frozen_bytes
    hybrid = s["hybrid"]
    assert all(m["frozen"] == 4 * hybrid["frozen_params"] > 0 for m in hybrid["memory"]["per_rank"])
    assert hybrid["predicted"]["memory_per_rank"]["frozen"] == 4 * hybrid["frozen_params"]


def test_refusals_say_why():
    with pytest.raises(ConfigError,
                       match=r'train.trainable = \["head.weight"\]: pipeline stage 0 of 2 holds no parameter'):
        _config("x", dict(OPTIMIZERS["sgd"], trainable=["head.weight"]), dict(PIPE, world_size=2))
    with pytest.raises(ConfigError,
                       match=r"leaves the table 'tables.0.weight' frozen, but backend.embeddings = \"ps\""):
        load_config(None, ["train.lora_rank=2", 'workload.model="dlrm"', 'workload.data="clicks"',
                           'backend.kind="ddp"', 'backend.embeddings="ps"', "backend.world_size=2"])
    with pytest.raises(ConfigError, match=r'backend.embeddings = "rows": frozen parameters and LoRA'):
        load_config(None, ["train.lora_rank=2", 'workload.model="dlrm"', 'workload.data="clicks"',
                           'backend.kind="ddp"', 'backend.embeddings="rows"'])


# ---------------------------------------------------------------- fine-tuning from a base checkpoint

FROM = {"pipeline": dict(PIPE, world_size=2), "torch_pipeline": dict(PIPE, kind="torch_pipeline", world_size=2),
        "tensor": {"kind": "tensor", "world_size": 2}, "torch_tensor": {"kind": "torch_tensor", "world_size": 2},
        "torch_fsdp": {"kind": "torch_fsdp", "world_size": 2}}
TUNE = dict(LORA, steps=4)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A full single run of 3 SGD steps checkpointed at step 3 (the base model), and single's LoRA fine-tune of it."""
    out = tmp_path_factory.mktemp("lorabase")
    run(_config("base", dict(OPTIMIZERS["sgd"], steps=3, checkpoint_every=3), {"kind": "single"}), out / "base",
        echo=False)
    ckpt = out / "base" / "checkpoints" / "step_000003"
    run(_config("tuned", TUNE, {"kind": "single"}), out / "tuned", echo=False, start=ckpt)
    return out, ckpt


@pytest.mark.slow
@pytest.mark.parametrize("name", FROM)
def test_from_the_base_checkpoint_equals_single(base, name):
    out, ckpt = base
    run(_config(name, TUNE, FROM[name]), out / name, echo=False, start=ckpt)
    a, b = _model(out, name), _model(out, "tuned")
    assert_same_model(a, b, f"{name} vs single from the base checkpoint", rtol=0, atol=SGD_ATOL)
    fresh = build_workload(_config("x", TUNE, {"kind": "single"})).model.state_dict()
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], fresh["blocks.0.attn.qkv.weight"])   # the base's, frozen


def test_a_pipeline_stage_holding_no_frozen_parameter_is_predicted_none():
    """Each stage keeps its own frozen weights (collective/pipeline/theory.py): with blocks 0, 1 and 3 training,
    stage 0 (embeddings, blocks 0 and 1) holds none, stage 1 block 2's; predict fills in no whole-model figure."""
    from psarch.theory import predict

    trains = ["embed.*", "pos.*", "blocks.0.*", "blocks.1.*", "blocks.3.*"]
    cfg = from_dict(config("x", train=dict(OPTIMIZERS["sgd"], trainable=trains), backend=dict(PIPE, world_size=2),
                           workload={"gpt": dict(GPT2["gpt"], n_layer=4)}))
    model = build_workload(cfg, device="meta").model
    phi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = {n: p.numel() for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("blocks.2.", "ln_f.", "head.")) for n in frozen)
    p = predict(cfg, phi, sum(frozen.values()))
    assert [r.memory.frozen for r in p.per_rank] == [0, 4 * sum(frozen.values())]
    assert p.memory_per_rank.frozen in (0, 4 * sum(frozen.values()))   # one stage's, not filled in
