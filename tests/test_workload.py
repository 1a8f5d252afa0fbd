"""Workloads: deterministic per-(seed, step) global batches and their shards, models, the text source,
and user factories. The Markov source: test_markov.py."""
from __future__ import annotations

import itertools
import math
import sys
import textwrap

import pytest
import torch

from psarch.config import ConfigError, load_config
from psarch.data import MarkovSource, TextSource, shard_batch, step_generator
from psarch.models import GPT, MLP
from psarch.workload import Workload, build_workload, next_token_loss


# ---------------------------------------------------------------- global batch and shards

def tiny_cfg(*extra: str):
    return load_config(None, ["workload.seq_len=8", "workload.gpt.n_layer=1", "workload.gpt.n_embd=16",
                              "workload.gpt.n_head=2", "workload.markov.vocab_size=16", "train.global_batch=8",
                              *extra])


@pytest.mark.parametrize("data", ["markov", "text"])
def test_global_batch_does_not_depend_on_num_shards(tmp_path, data):
    extra = []
    if data == "text":
        path = tmp_path / "t.txt"
        path.write_bytes(bytes(range(256)) * 4)
        extra = ["workload.data=text", f"workload.text.path={path}"]
    wl = build_workload(tiny_cfg(*extra))
    for step in (0, 1, 17):
        whole = wl.batch(step, 0, 1)
        assert whole.shape == (8, 9)                                   # global_batch x (seq_len + 1)
        for n in (2, 4, 8):
            shards = [wl.batch(step, r, n) for r in range(n)]
            assert all(s.shape == (8 // n, 9) for s in shards)
            assert torch.equal(torch.cat(shards), whole), (step, n)
    # different steps differ; the same step is the same every time, in a fresh workload too
    assert not torch.equal(wl.batch(0, 0, 1), wl.batch(1, 0, 1))
    assert torch.equal(wl.batch(3, 0, 1), build_workload(tiny_cfg(*extra)).batch(3, 0, 1))


def test_different_seeds_give_different_batches():
    a = build_workload(tiny_cfg("seed=1")).batch(0, 0, 1)
    b = build_workload(tiny_cfg("seed=2")).batch(0, 0, 1)
    assert not torch.equal(a, b)


def test_step_generators_are_distinct():
    draws = {(seed, step): torch.randint(0, 2**62, (1,), generator=step_generator(seed, step)).item()
             for seed, step in itertools.product(range(4), range(50))}
    assert len(set(draws.values())) == len(draws)


def test_shard_rows():
    b = torch.arange(12).reshape(6, 2)
    assert torch.equal(shard_batch(b, 1, 3), b[2:4])
    assert torch.equal(torch.cat([shard_batch(b, r, 2) for r in range(2)]), b)
    with pytest.raises(ValueError, match="4 equal shards"):
        shard_batch(b, 0, 4)


# ---------------------------------------------------------------- models

def test_same_seed_same_initial_model_other_seed_other_model():
    a, b = build_workload(tiny_cfg("seed=4")), build_workload(tiny_cfg("seed=4"))
    torch.manual_seed(123)  # global RNG state in between must not matter
    c = build_workload(tiny_cfg("seed=4"))
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sc[k]) for k in sa)
    d = build_workload(tiny_cfg("seed=5")).model.state_dict()
    assert any(not torch.equal(sa[k], d[k]) for k in sa)
    m1 = build_workload(tiny_cfg("seed=4", "workload.model=mlp")).model.state_dict()
    m2 = build_workload(tiny_cfg("seed=4", "workload.model=mlp")).model.state_dict()
    assert all(torch.equal(m1[k], m2[k]) for k in m1)


def test_gpt_forward_shape_and_causality():
    torch.manual_seed(0)
    m = GPT(vocab_size=16, seq_len=8, n_layer=2, n_embd=16, n_head=2)
    idx = torch.randint(0, 16, (3, 8))
    out = m(idx)
    assert out.shape == (3, 8, 16)
    assert m(idx[:, :5]).shape == (3, 5, 16)                           # shorter sequences are fine
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % 16                               # changing the last token
    assert torch.allclose(m(idx2)[:, :-1], out[:, :-1], atol=1e-6)     # leaves earlier positions alone
    with pytest.raises(ValueError, match="seq_len"):
        m(torch.randint(0, 16, (1, 9)))
    assert len(m.blocks) == 2


def test_mlp_forward_shape():
    m = MLP(vocab_size=16, n_embd=8, hidden=12, n_layer=3)
    assert m(torch.randint(0, 16, (3, 7))).shape == (3, 7, 16)
    assert len(m.blocks) == 3


def test_built_in_workload_loss_starts_near_log_vocab():
    wl = build_workload(tiny_cfg())
    assert wl.name == "gpt/markov"
    assert wl.entropy_floor == pytest.approx(MarkovSource(16, 4, 0).entropy_rate)
    loss = wl.loss_fn(wl.model, wl.batch(0, 0, 1))
    assert loss.dim() == 0 and abs(loss.item() - math.log(16)) < 0.3  # small init: near-uniform predictions
    tokens = wl.batch(0, 0, 1)
    logits = wl.model(tokens[:, :-1])
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), tokens[:, 1:].reshape(-1))
    assert next_token_loss(wl.model, tokens).item() == pytest.approx(ref.item(), rel=1e-6)


# ---------------------------------------------------------------- text source

def test_text_source_samples_bytes_of_the_file(tmp_path):
    data = bytes(range(200, 256)) + b"hello, world\n" * 3
    path = tmp_path / "t.txt"
    path.write_bytes(data)
    src = TextSource(str(path))
    assert src.vocab_size == 256 and src.entropy_rate is None
    x = src.sample(64, 10, torch.Generator().manual_seed(0))
    assert x.dtype == torch.int64 and x.shape == (64, 10)
    assert int(x.min()) >= 0 and int(x.max()) < 256
    for row in x.tolist():                     # each row is a contiguous piece of the file
        assert bytes(row) in data
    assert int(x.max()) >= 200                 # bytes above 127 come through unchanged
    # a file exactly one sequence long gives that sequence (every byte is reachable)
    exact = tmp_path / "exact.txt"
    exact.write_bytes(b"0123456789")
    y = TextSource(str(exact)).sample(3, 10, torch.Generator().manual_seed(0))
    assert all(bytes(r) == b"0123456789" for r in y.tolist())
    with pytest.raises(ValueError, match="bytes"):
        TextSource(str(exact)).sample(1, 11, torch.Generator())


def test_text_source_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        TextSource(str(tmp_path / "none.txt"))


def test_text_workload(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 5)
    wl = build_workload(tiny_cfg("workload.data=text", f"workload.text.path={path}"))
    assert wl.entropy_floor is None and wl.name == "gpt/text"
    assert wl.model.head.out_features == 256
    assert torch.isfinite(wl.loss_fn(wl.model, wl.batch(0, 0, 1)))


# ---------------------------------------------------------------- user factories

FACTORY_MODULE = textwrap.dedent('''
    import torch
    from psarch import Workload

    CALLS = []

    def make(cfg):
        CALLS.append(cfg.seed)
        model = torch.nn.Linear(3, 1)
        def loss_fn(model, batch):
            x, y = batch
            return ((model(x) - y) ** 2).mean()
        def batch(step, shard, num_shards):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 3, generator=g)
            per = 8 // num_shards
            return x[shard * per:(shard + 1) * per], x[shard * per:(shard + 1) * per].sum(1, keepdim=True)
        return Workload(model, loss_fn, batch, name="linear")

    def make_no_args():
        return Workload(torch.nn.Linear(2, 2), lambda m, b: m(b).sum(), lambda s, i, n: torch.ones(1, 2))

    def wrong_type(cfg):
        return {"model": None}

    def make_keyword_only(*, width=3, **options):   # no positional parameter: called with nothing
        return Workload(torch.nn.Linear(width, 2), lambda m, b: m(b).sum(), lambda s, i, n: torch.ones(1, width))

    def make_var_positional(*args):                 # takes the config through *args
        CALLS.append(args[0].seed)
        return make_no_args()
''')


@pytest.fixture
def factory_module(tmp_path, monkeypatch, request):
    name = f"psarch_test_factory_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_factory_loads_and_gets_the_config(factory_module):
    cfg = load_config(None, [f"workload.factory={factory_module}:make", "seed=9"])
    wl = build_workload(cfg)
    assert isinstance(wl, Workload) and wl.name == "linear"
    assert sys.modules[factory_module].CALLS == [9]
    x, y = wl.batch(2, 1, 2)
    assert x.shape == (4, 3) and y.shape == (4, 1)
    assert wl.loss_fn(wl.model, (x, y)).dim() == 0
    # seeded before the factory runs: the same initial model every time
    again = build_workload(cfg)
    assert torch.equal(again.model.weight, wl.model.weight)


def test_factory_without_arguments(factory_module):
    wl = build_workload(load_config(None, [f"workload.factory={factory_module}:make_no_args"]))
    assert isinstance(wl.model, torch.nn.Linear) and wl.model.in_features == 2


def test_factory_with_keyword_only_parameters_gets_no_config(factory_module):
    wl = build_workload(load_config(None, [f"workload.factory={factory_module}:make_keyword_only"]))
    assert wl.model.in_features == 3
    build_workload(load_config(None, [f"workload.factory={factory_module}:make_var_positional", "seed=4"]))
    assert sys.modules[factory_module].CALLS == [4]


def test_factory_missing_module():
    with pytest.raises(ConfigError) as e:
        build_workload(load_config(None, ["workload.factory=psarch_no_such_module_xyz:make"]))
    msg = str(e.value)
    assert "workload.factory" in msg and "psarch_no_such_module_xyz" in msg and "cannot import" in msg
    assert "\n" not in msg


def test_factory_missing_function(factory_module):
    with pytest.raises(ConfigError) as e:
        build_workload(load_config(None, [f"workload.factory={factory_module}:nope"]))
    msg = str(e.value)
    assert f"{factory_module}:nope" in msg and "cannot import" in msg and "nope" in msg.split("cannot import")[1]


def test_factory_wrong_return_type(factory_module):
    with pytest.raises(ConfigError) as e:
        build_workload(load_config(None, [f"workload.factory={factory_module}:wrong_type"]))
    msg = str(e.value)
    assert f"{factory_module}:wrong_type" in msg and "returned dict" in msg and "psarch.Workload" in msg


def test_factory_wrong_return_type_is_reported_before_any_rank_starts(factory_module, tmp_path):
    from psarch.launch.ranks import run

    cfg = load_config(None, [f"workload.factory={factory_module}:wrong_type", "backend.kind=ddp",
                             "backend.world_size=2"])
    with pytest.raises(ConfigError, match="returned dict, expected psarch.Workload"):
        run(cfg, tmp_path / "out", echo=False)
    assert not (tmp_path / "out").exists()   # nothing prepared, no rank spawned


# ---------------------------------------------------------------- builds for theory (the meta device)

def test_a_meta_build_builds_its_data_source_at_its_first_batch(monkeypatch):
    """Theory's builds (shapes on the meta device) read no data: the Markov source, seconds at a GPT's vocabulary,
    is built when a batch first needs it; a real build knows its floor, a meta build none."""
    import psarch.workload as wl

    built = []

    def counted(*args, **kwargs):
        built.append(args)
        return MarkovSource(*args, **kwargs)

    monkeypatch.setattr(wl, "MarkovSource", counted)
    meta = build_workload(tiny_cfg(), device="meta")
    assert built == [] and meta.entropy_floor is None
    assert meta.model.head.weight.shape[0] == 16   # the vocabulary from the config, no source read
    cfg = tiny_cfg()
    real = build_workload(cfg)
    m = cfg.workload.markov
    assert len(built) == 1 and real.entropy_floor == MarkovSource(16, m.branching, cfg.seed, m.concentration).entropy_rate
    assert torch.equal(meta.batch(2, 0, 1), real.batch(2, 0, 1)) and len(built) == 2
    meta.batch(3, 0, 1)
    assert len(built) == 2   # built once


def test_theory_model_is_built_once_per_model(monkeypatch):
    """theory_model: one meta build per model, whatever the backend and world size around it."""
    import psarch.workload as wl

    calls = []
    real = wl.build_workload
    monkeypatch.setattr(wl, "build_workload", lambda cfg, device=None: calls.append(device) or real(cfg, device))
    monkeypatch.setattr(wl, "_THEORY_MODELS", {})
    a = wl.theory_model(tiny_cfg("backend.kind=ddp", "backend.world_size=2"))
    assert wl.theory_model(tiny_cfg("backend.kind=zero", "backend.world_size=4")) is a and calls == ["meta"]
    other = wl.theory_model(tiny_cfg("workload.gpt.n_layer=2"))
    assert other is not a and calls == ["meta", "meta"] and all(p.is_meta for p in other.parameters())
    assert len(other.blocks) == 2 and len(a.blocks) == 1


@pytest.mark.parametrize("model", ["gpt", "mlp", "dlrm"])
def test_a_meta_build_has_the_real_builds_parameters_without_initialising_them(model):
    """Built on the meta device, without the fills that have nothing to fill there: the same parameters (names,
    shapes, dtypes, which train) as the real build."""
    extra = ["workload.model=dlrm", "workload.data=clicks", "workload.dlrm.rows=100"] if model == "dlrm" else \
        [f"workload.model={model}"]
    meta, real = (build_workload(tiny_cfg(*extra), device=d).model for d in ("meta", None))
    assert all(p.is_meta for p in meta.parameters())
    assert [(n, p.shape, p.dtype, p.requires_grad) for n, p in meta.named_parameters()] == \
        [(n, p.shape, p.dtype, p.requires_grad) for n, p in real.named_parameters()]


def test_a_meta_build_does_not_import_torchs_compiler(tmp_path):
    """torch's meta kernel for a random draw imports torch._dynamo at its first call (about 1.7 s of CPU); a meta
    build draws nothing."""
    import subprocess

    code = ("import sys\nfrom psarch.config import load_config\nfrom psarch.workload import build_workload\n"
            "build_workload(load_config(None, ['workload.gpt.n_layer=2']), device='meta')\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
