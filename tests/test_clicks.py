"""Click data: the Zipf sampler against its law, the loss floor (against an exact sum, against the true
model's loss on sampled clicks, and approached by training), and batches that do not depend on the
world size."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from psarch.config import ConfigError, from_dict
from psarch.data import ClickSource, clicks_hidden, step_generator
from psarch.data.clicks import DENSE_STD, ZipfSampler
from psarch.models import DLRM
from psarch.optim import build_optimizer
from psarch.workload import build_workload, shared_data


@pytest.mark.parametrize("exponent", [0.0, 1.2])
def test_zipf_frequencies_follow_the_law(exponent):
    """200k draws over 30 ids: each id's frequency within 5 standard errors of its law's probability,
    and the hot ids are where the permutation put them, not at the front of the table."""
    rows, n = 30, 200_000
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(4)).view(1, rows)
    sampler = ZipfSampler(rows, exponent, perm)
    law = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
    law /= law.sum()
    np.testing.assert_allclose(sampler.probs, law, rtol=1e-12)
    ids = sampler.sample(n, 1, torch.Generator().manual_seed(5)).view(-1).numpy()
    freq_by_rank = np.bincount(ids, minlength=rows)[perm[0].numpy()] / n
    se = np.sqrt(law * (1 - law) / n)
    assert (np.abs(freq_by_rank - law) < 5 * se).all(), np.abs(freq_by_rank - law) / se
    if exponent > 0:
        assert np.bincount(ids, minlength=rows).argmax() == perm[0, 0] != 0


def _dense_integral(s: np.ndarray, bias: float) -> np.ndarray:
    """E over u ~ N(0, DENSE_STD²) of h(sigmoid(bias + s + u)) by a fine trapezoid rule (not quadrature)."""
    u = np.linspace(-10 * DENSE_STD, 10 * DENSE_STD, 4001)
    density = np.exp(-0.5 * (u / DENSE_STD) ** 2) / (DENSE_STD * math.sqrt(2 * math.pi))
    p = 1 / (1 + np.exp(-(bias + s[:, None] + u)))
    h = -p * np.log(p) - (1 - p) * np.log1p(-p)
    return np.trapezoid(h * density, u, axis=1)


def test_floor_equals_the_exact_conditional_entropy():
    """Two tables of 12 rows: the floor summed exactly over all 144 id pairs agrees with the source's
    Monte-Carlo floor within 4 of its stated standard errors, and that error is below 1e-3 nats."""
    src = ClickSource(num_tables=2, rows=12, bag=1, dense=3, zipf=1.5, seed=9)
    p = src.sampler.probs
    w0, w1 = (src.row_weights[t, src.sampler.perm[t]].numpy() for t in range(2))  # weights by rank
    s = (w0[:, None] + w1[None, :]).ravel()
    exact = float((np.outer(p, p).ravel() * _dense_integral(s, src.bias)).sum())
    assert 0 < src.floor_stderr < 1e-3
    assert abs(src.entropy_rate - exact) < 4 * src.floor_stderr, (src.entropy_rate, exact, src.floor_stderr)
    assert exact < math.log(2) - 0.1  # the ids carry real signal


def true_model(src: ClickSource, dim: int = 4) -> DLRM:
    """A DLRM (cat, no hidden layers: a logistic model) set to the source's hidden model."""
    model = DLRM(src.dense, src.num_tables, src.rows, dim, [], [], "cat").double()
    bottom, top = model.blocks[0][0], model.blocks[1][0]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        bottom.weight[0] = src.dense_weights           # coordinate 0 of the bottom output is v·x
        top.weight[0, 0] = 1.0
        top.bias[0] = src.bias
        for t, table in enumerate(model.tables):       # coordinate 0 of table t's vector is w_t[id]
            table.weight[:, 0] = src.row_weights[t]
            top.weight[0, (t + 1) * dim] = 1.0
    return model


def test_the_true_model_reaches_the_floor():
    """The hidden model's mean loss on 2^16 sampled clicks (bags of 3 ids) is the floor within 4 standard
    errors of that mean; a model at half its weights is clearly above it."""
    src = ClickSource(num_tables=3, rows=50, bag=3, dense=5, zipf=1.1, seed=2)
    dense, ids, clicks = src.sample(2**16, step_generator(2, 0))
    with torch.no_grad():
        logits = true_model(src)(dense.double(), ids)
    torch.testing.assert_close(logits, src.true_logits(dense, ids))
    losses = F.binary_cross_entropy_with_logits(logits, clicks.double(), reduction="none")
    se = float(losses.std() / math.sqrt(losses.numel()))
    assert abs(float(losses.mean()) - src.entropy_rate) < 4 * se + 4 * src.floor_stderr
    half = F.binary_cross_entropy_with_logits(logits.sub(src.bias).mul(0.5).add(src.bias), clicks.double())
    assert float(half) > src.entropy_rate + 0.02


def expected_gap(wl, src_cfg: dict, steps=range(10**6, 10**6 + 8)) -> float:
    """Mean KL(true || model) over held-out batches: the expected loss above the floor, free of label noise."""
    src = ClickSource(**src_cfg)
    gaps = []
    with torch.no_grad():
        for step in steps:
            dense, ids, _ = wl.batch(step, 0, 1)
            p, z = torch.sigmoid(src.true_logits(dense, ids)), wl.model(dense, ids).double()
            log_q, log_1q = F.logsigmoid(z), F.logsigmoid(-z)
            kl = p * (torch.log(p) - log_q) + (1 - p) * (torch.log1p(-p) - log_1q)
            gaps.append(float(kl.mean()))
    return float(np.mean(gaps))


def test_a_trained_model_approaches_the_floor():
    """A small DLRM trained with Adagrad on uniform ids (every row seen often) closes most of the gap."""
    torch.set_num_threads(1)
    d = {"num_tables": 2, "rows": 20, "dim": 8, "bottom_mlp": [16], "top_mlp": [16], "interaction": "cat"}
    cfg = from_dict({"seed": 5, "workload": {"model": "dlrm", "data": "clicks", "dlrm": d,
                                             "clicks": {"zipf": 0.0, "dense": 4}},
                     "train": {"optimizer": "adagrad", "lr": 0.1, "global_batch": 256}})
    wl = build_workload(cfg)
    src_cfg = {"num_tables": 2, "rows": 20, "bag": 1, "dense": 4, "zipf": 0.0, "seed": 5}
    before = expected_gap(wl, src_cfg)
    opt = build_optimizer(wl.model.parameters(), cfg.train)
    for step in range(300):
        opt.zero_grad()
        wl.loss_fn(wl.model, wl.batch(step, 0, 1)).backward()
        opt.step()
    after = expected_gap(wl, src_cfg)
    assert before > 0.1 and after < 0.02, (before, after)


def test_batches_are_the_same_at_every_world_size():
    cfg = from_dict({"seed": 7, "workload": {"model": "dlrm", "data": "clicks", "dlrm": {"rows": 100, "bag": 2}},
                     "train": {"global_batch": 12}})
    a, b = build_workload(cfg), build_workload(cfg)
    whole = a.batch(3, 0, 1)
    assert [x.shape for x in whole] == [(12, 13), (12, 4, 2), (12,)]
    assert whole[1].max() < 100 and set(whole[2].unique().tolist()) <= {0.0, 1.0}
    for n in (2, 3, 4):
        shards = [b.batch(3, r, n) for r in range(n)]
        for i in range(3):
            assert torch.equal(torch.cat([s[i] for s in shards]), whole[i])
    assert not torch.equal(a.batch(4, 0, 1)[1], whole[1])
    assert a.entropy_floor == b.entropy_floor


@pytest.mark.parametrize("overrides, message", [
    ({"workload.model": "dlrm"}, 'workload.model = "dlrm": model "dlrm" and data "clicks" go together'),
    ({"workload.data": "clicks"}, 'workload.data = "clicks": model "dlrm" and data "clicks" go together'),
    ({"workload.model": "dlrm", "workload.data": "clicks", "workload.dlrm.bottom_mlp": [8, 0]},
     "workload.dlrm.bottom_mlp = [8, 0]: expected a list of widths >= 1"),
    ({"workload.model": "dlrm", "workload.data": "clicks", "workload.dlrm.top_mlp": ["a"]},
     'workload.dlrm.top_mlp = ["a"]: expected a list of widths >= 1'),
    ({"workload.clicks.zipf": -1.0}, "workload.clicks.zipf = -1.0: must be >= 0"),
    ({"backend.kind": "zero", "backend.world_size": 2, "backend.embeddings": "rows"},
     'backend.embeddings = "rows": backend.kind = "zero" runs "dense", "ps"; "rows" runs on backend.kind = "ddp", "ps", '
     '"torch_ddp"'),
    ({"backend.kind": "ddp", "backend.world_size": 2, "backend.embeddings": "rows"},
     'backend.embeddings = "rows": needs the built-in workload.model = "dlrm"'),
    ({"backend.embeddings": "sharded", "backend.kind": "zero"},
     'backend.embeddings = "sharded": backend.kind = "zero" runs "dense", "ps"; "sharded" runs on backend.kind = "ddp"'),
    ({"backend.embeddings": "sharded", "backend.kind": "ddp"}, 'backend.embeddings = "sharded": needs the built-in'),
    ({"backend.embeddings": "sharded", "backend.kind": "ddp", "workload.model": "dlrm", "workload.data": "clicks",
      "train.precision": "fp16"}, 'train.precision = "fp16": backend.embeddings = "sharded" runs fp32 or bf16'),
    *[({"workload.model": "dlrm", "workload.data": "clicks", "backend.kind": "torch_ddp", "backend.world_size": 2,
        "backend.embeddings": "rows", **train}, message) for train, message in (
        ({"train.optimizer": "adamw"}, 'train.optimizer = "adamw": torch\'s AdamW refuses sparse gradients'),
        ({"train.optimizer": "adagrad", "train.weight_decay": 0.01},
         "train.weight_decay = 0.01: torch's adagrad refuses weight decay on sparse gradients"),
        ({"train.optimizer": "sgd", "train.precision": "bf16"},
         'train.precision = "bf16": sparse gradients step in fp32 only'))],
])
def test_bad_click_configs_are_refused_in_one_line(overrides, message):
    from psarch.config import apply_overrides
    with pytest.raises(ConfigError) as e:
        from_dict(apply_overrides({}, overrides))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, message", [({"rows": 0}, "rows = 0"), ({"zipf": -0.5}, "zipf = -0.5"),
                                             ({"bag": 0}, "bag = 0")])
def test_bad_click_source_arguments(kwargs, message):
    args = dict(num_tables=1, rows=5, bag=1, dense=2, zipf=1.0, seed=0) | kwargs
    with pytest.raises(ValueError, match=message):
        ClickSource(**args)


def test_expected_unique_matches_the_sampler():
    """E[distinct ids in d draws] = Σ 1 − (1 − p_k)^d, checked against the sampler's own draws."""
    from psarch.zipf import expected_unique
    from psarch.embeddings import unique_ids
    rows, draws = 2000, 256
    assert expected_unique(rows, 0.0, 1) == pytest.approx(1.0)
    assert expected_unique(rows, 0.0, 10**7) == pytest.approx(rows, rel=1e-6)   # every row seen
    src = ClickSource(2, rows, 1, 3, 1.05, seed=0)
    gen = torch.Generator().manual_seed(1)
    counts = [len(u) for _ in range(200) for u in unique_ids(src.sample(draws, gen))]
    expected = expected_unique(rows, 1.05, draws)
    assert abs(sum(counts) / len(counts) - expected) < 0.01 * expected
    assert expected < 0.7 * draws   # skewed ids repeat: fewer rows than draws


def test_a_mapped_hidden_model_is_the_built_one_and_is_not_copied(tmp_path, monkeypatch):
    """Ranks started under clicks_hidden.shared map the launcher's hidden model (read-only, in the page cache)
    instead of each building 128 MB of it: the same arrays bit for bit, so the same samples; a folder holding
    another source's hidden model is not used."""
    args = dict(num_tables=3, rows=40, bag=2, dense=4, zipf=1.1, seed=7)
    built = ClickSource(**args)
    builds = []
    real_build = clicks_hidden.build
    monkeypatch.setattr(clicks_hidden, "build", lambda *a: builds.append(a) or real_build(*a))
    with clicks_hidden.shared(tmp_path / "shared", 3, 40, 4, 7):
        assert builds == [(3, 40, 4, 7)]       # by the launcher, once
        mapped = ClickSource(**args)
        assert builds == [(3, 40, 4, 7)]       # not again by the rank
        ClickSource(**dict(args, seed=8))
        assert builds[1:] == [(3, 40, 4, 8)]   # the folder held seed 7's: built
    assert not (tmp_path / "shared").exists()
    for a, b in ((built.row_weights, mapped.row_weights), (built.sampler.perm, mapped.sampler.perm),
                 (built.dense_weights, mapped.dense_weights)):
        assert torch.equal(a, b)
    assert built.entropy_rate == mapped.entropy_rate
    for x, y in zip(*(s.sample(64, torch.Generator().manual_seed(1)) for s in (built, mapped))):
        assert torch.equal(x, y)


def test_the_launcher_shares_the_hidden_model_only_where_ranks_would_each_build_it(tmp_path):
    dlrm = {"model": "dlrm", "data": "clicks", "dlrm": {"num_tables": 2, "rows": 30, "dim": 4}}
    cases = [({"workload": dlrm, "backend": {"kind": "ps", "world_size": 2, "embeddings": "rows"}}, True),
             ({"workload": dlrm, "backend": {"kind": "ddp", "world_size": 2}}, True),
             ({"workload": dlrm}, False),                                   # one process: nothing to share
             ({"backend": {"kind": "ddp", "world_size": 2}}, False)]        # gpt on markov
    for data, shares in cases:
        with shared_data(from_dict(data), tmp_path / "shared"):
            assert (os.environ.get(clicks_hidden.ENV) == str(tmp_path / "shared")) == shares
            assert (tmp_path / "shared" / "key.json").is_file() == shares
        assert clicks_hidden.ENV not in os.environ and not (tmp_path / "shared").exists()


def test_ranks_read_the_floor_the_launcher_shares_instead_of_computing_it(tmp_path, monkeypatch):
    """The floor (a quarter of a CPU-s of sampling) is computed once by the launcher within shared_data and read by
    every rank, the same float bit for bit (an earlier run's file never passed on); a rank of another source (seed)
    computes its own."""
    from psarch.data import clicks
    cfg = from_dict({"seed": 7, "workload": {"model": "dlrm", "data": "clicks",
                                             "dlrm": {"num_tables": 2, "rows": 30, "dim": 4, "bag": 3}},
                     "backend": {"kind": "ddp", "world_size": 2}})
    c = cfg.workload.clicks
    args = dict(num_tables=2, rows=30, bag=3, dense=c.dense, zipf=c.zipf, seed=7)
    monkeypatch.setattr(clicks, "_FLOORS", {})
    computed = ClickSource(**args)
    computed_floor = (computed.entropy_rate, computed.floor_stderr)
    (tmp_path / "shared").mkdir()   # a crashed earlier run's file, of the same source: never passed on
    (tmp_path / "shared" / clicks.FLOOR_FILE).write_text(json.dumps({"key": list(args.values()), "floor": [9.0, 0.0]}))
    with shared_data(cfg, tmp_path / "shared"):
        assert (tmp_path / "shared" / clicks.FLOOR_FILE).is_file()
        monkeypatch.setattr(clicks, "_FLOORS", {})   # a rank: a fresh process
        sampled = []
        real_floor = ClickSource._floor
        monkeypatch.setattr(ClickSource, "_floor", lambda self, gen: sampled.append(1) or real_floor(self, gen))
        rank = ClickSource(**args)
        assert sampled == [] and (rank.entropy_rate, rank.floor_stderr) == computed_floor
        other = ClickSource(**dict(args, seed=8))
        assert sampled == [1] and other.entropy_rate != rank.entropy_rate
