"""Workloads: the Markov source's exact entropy rate, deterministic per-(seed, step) global batches and
their shards, models, the text source, and user factories."""
from __future__ import annotations

import itertools
import math
import sys
import textwrap

import numpy as np
import pytest
import torch

from psarch.config import ConfigError, load_config
from psarch.data import MarkovSource, TextSource, shard_rows, step_generator
from psarch.models import GPT, MLP
from psarch.workload import Workload, build_workload, next_token_loss


def transition_matrix(src: MarkovSource) -> np.ndarray:
    v = src.vocab_size
    p = np.zeros((v, v))
    for s in range(v):
        for t, q in zip(src.successors[s].tolist(), src.probs[s].tolist()):
            p[s, t] += q
    return p


# ---------------------------------------------------------------- Markov source

@pytest.mark.parametrize("vocab, branching, concentration", [(16, 4, 1.0), (12, 12, 0.3), (8, 1, 1.0)])
def test_markov_stationary_distribution(vocab, branching, concentration):
    src = MarkovSource(vocab, branching, seed=3, concentration=concentration)
    p = transition_matrix(src)
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-12)            # rows are distributions
    pi = src.stationary.numpy()
    assert pi.shape == (vocab,) and (pi >= 0).all()
    assert pi.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(pi @ p, pi, atol=1e-10)                # pi P = pi
    assert (src.successors[:, 0] == (torch.arange(vocab) + 1) % vocab).all()  # s -> s+1: irreducible


def test_markov_entropy_rate_formula():
    src = MarkovSource(16, 4, seed=0)
    p = transition_matrix(src)
    pi = src.stationary.numpy()
    logp = np.log(np.where(p > 0, p, 1.0))
    assert src.entropy_rate == pytest.approx(float(-(pi[:, None] * p * logp).sum()), rel=1e-12)
    assert 0 < src.entropy_rate < math.log(4)  # at most log(branching)
    assert MarkovSource(8, 1, seed=0).entropy_rate == pytest.approx(0.0, abs=1e-12)  # deterministic chain


def test_markov_entropy_rate_matches_empirical_conditional_entropy():
    """Plug-in estimate of H(X_t | X_{t-1}) from 2000 x 100 = 200k sampled transitions.

    Tolerance 0.01 nats: the estimator's standard error is about sd(-log p) / sqrt(200k) ~ 0.002 and its
    bias about (nonzero cells - rows) / (2 * 200k) ~ 1e-4, so 0.01 is ~5 standard errors, while a wrong
    chain (e.g. sampling from uniform successors, entropy log 4 = 1.386) is off by far more."""
    src = MarkovSource(16, 4, seed=7)
    x = src.sample(2000, 101, torch.Generator().manual_seed(1)).numpy()
    prev, nxt = x[:, :-1].ravel(), x[:, 1:].ravel()
    counts = np.zeros((16, 16))
    np.add.at(counts, (prev, nxt), 1)
    # every sampled transition is an edge of the chain
    assert ((counts > 0) <= (transition_matrix(src) > 0)).all()
    n = counts.sum()
    row = counts.sum(1, keepdims=True)
    nz = counts > 0
    h_emp = -(counts[nz] / n * np.log((counts / np.maximum(row, 1))[nz])).sum()
    assert abs(h_emp - src.entropy_rate) < 0.01, (h_emp, src.entropy_rate)
    # the first token is drawn from the stationary distribution
    first = np.bincount(x[:, 0], minlength=16) / x.shape[0]
    assert np.abs(first - src.stationary.numpy()).max() < 0.05


def dense_stationary(p: np.ndarray) -> np.ndarray:
    """pi P = pi, sum pi = 1, by a dense least-squares solve (the reference; O(v^3))."""
    v = p.shape[0]
    a = np.vstack([p.T - np.eye(v), np.ones((1, v))])
    return np.linalg.lstsq(a, np.r_[np.zeros(v), 1.0], rcond=None)[0]


@pytest.mark.parametrize("vocab, branching, concentration", [
    (16, 4, 1.0), (200, 4, 1.0), (300, 2, 1e-6),   # 1e-6: rows nearly deterministic, the slowest mixing allowed
    (12, 12, 0.3), (50, 1, 1.0)])
def test_markov_stationary_distribution_matches_a_dense_solve(vocab, branching, concentration):
    src = MarkovSource(vocab, branching, seed=5, concentration=concentration)
    p = transition_matrix(src)
    ref = dense_stationary(p)
    pi = src.stationary.numpy()
    assert np.abs(pi - ref).sum() < 1e-9
    logp = np.log(np.where(p > 0, p, 1.0))
    assert src.entropy_rate == pytest.approx(float(-(ref[:, None] * p * logp).sum()), abs=1e-10)


def test_markov_stationary_distribution_of_a_periodic_chain():
    """A chain of period 2 (even -> odd -> even): plain power iteration oscillates; the lazy chain converges."""
    succ = np.array([[1, 3], [2, 0], [3, 1], [0, 2]])
    probs = np.array([[0.9, 0.1], [0.3, 0.7], [0.5, 0.5], [0.2, 0.8]])
    p = np.zeros((4, 4))
    for s in range(4):
        p[s, succ[s]] = probs[s]
    np.testing.assert_allclose(MarkovSource._stationary(succ, probs), dense_stationary(p), atol=1e-12)


def test_markov_chain_is_unchanged_by_the_fast_construction():
    """The O(v * branching) construction draws the same chain as the earlier O(v^2) one: the entropy
    floors of runs already recorded stay valid (reference values from that construction)."""
    assert MarkovSource(64, 4, seed=0).entropy_rate == pytest.approx(1.0792797301192985, abs=1e-12)
    assert MarkovSource(200, 3, 5, 1e-6).entropy_rate == pytest.approx(0.015785937351260056, abs=1e-12)
    assert MarkovSource(12, 12, 3, 0.3).entropy_rate == pytest.approx(1.6182730881089857, abs=1e-12)


def test_markov_large_vocabulary_is_sparse_and_quick():
    """The largest vocabulary the config allows: a dense v x v solve would need 32 GiB and hours."""
    v = 2**16
    src = MarkovSource(v, 4, seed=0)
    pi, succ, probs = src.stationary.numpy(), src.successors.numpy(), src.probs.numpy()
    moved = np.bincount(succ.ravel(), weights=(pi[:, None] * probs).ravel(), minlength=v)  # pi P, sparse
    assert np.abs(moved - pi).sum() < 1e-12 and pi.sum() == pytest.approx(1.0, abs=1e-12)
    assert 0 < src.entropy_rate < math.log(4)


def test_markov_samples_are_deterministic_and_in_range():
    src = MarkovSource(16, 4, seed=0)
    a = src.sample(4, 9, torch.Generator().manual_seed(5))
    b = src.sample(4, 9, torch.Generator().manual_seed(5))
    assert a.dtype == torch.int64 and a.shape == (4, 9)
    assert torch.equal(a, b)
    assert int(a.min()) >= 0 and int(a.max()) < 16
    assert not torch.equal(a, src.sample(4, 9, torch.Generator().manual_seed(6)))


def test_markov_same_seed_same_chain_other_seed_other_chain():
    a, b, c = MarkovSource(16, 4, 1), MarkovSource(16, 4, 1), MarkovSource(16, 4, 2)
    assert torch.equal(a.probs, b.probs) and torch.equal(a.successors, b.successors)
    assert not torch.equal(a.probs, c.probs)


def test_markov_branching_larger_than_vocab_raises():
    with pytest.raises(ValueError, match="branching"):
        MarkovSource(4, 5, 0)


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
    assert torch.equal(shard_rows(b, 1, 3), b[2:4])
    assert torch.equal(torch.cat([shard_rows(b, r, 2) for r in range(2)]), b)
    with pytest.raises(ValueError, match="4 equal shards"):
        shard_rows(b, 0, 4)


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
