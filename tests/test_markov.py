"""The Markov source: its stationary distribution and exact entropy rate (against a dense solve and
against sampled sequences), determinism, and a large sparse vocabulary."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from psarch.data import MarkovSource


def transition_matrix(src: MarkovSource) -> np.ndarray:
    v = src.vocab_size
    p = np.zeros((v, v))
    for s in range(v):
        for t, q in zip(src.successors[s].tolist(), src.probs[s].tolist()):
            p[s, t] += q
    return p


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
