"""A barrier round's sum does not depend on the order pushes arrive in: the dense range sums in worker order
(early pushes kept until the gap fills, a worker lost without pushing skipped), and so do a round's rows."""
from __future__ import annotations

import time

import pytest
import torch

from psarch.config import from_dict
from psarch.ps.rows import key_space
from psarch.ps.server.row_shard import RowShard
from test_ps_rows import ROWS_DLRM
from ps_setup import config

N = 4


def _grads(numel: int) -> list[torch.Tensor]:
    """Gradients of mixed magnitudes: fp32 sums of them in different orders differ in their last bits."""
    g = torch.Generator().manual_seed(3)
    return [torch.randn(numel, generator=g) * s for s in (1.0, 0.3, 3.0, 0.7)]


def _fetch(raw) -> torch.Tensor:
    r = raw.ask({"op": "fetch", "worker": raw.worker})
    assert r.op == "params", r.header
    return r.tensor().clone()


def _in_order(grads: list[torch.Tensor], workers: list[int]) -> torch.Tensor:
    acc = grads[workers[0]].clone()
    for w in workers[1:]:
        acc.add_(grads[w])
    return acc


def _round(server, arrivals: list[int], lose: tuple[int, int] | None = None) -> tuple[torch.Tensor, int]:
    """A fresh sync server with N workers: push in `arrivals` order (lose=(w, after): worker w is lost after
    that many pushes); the parameters after the round, and the most bytes the server kept early, in pushes."""
    services, numel = server("sync", workers=N)
    addr = services.info.addresses[0]
    raw = {w: server.raw(addr, w) for w in range(N)}
    for w, r in raw.items():
        r.worker = w
    before = _fetch(raw[arrivals[-1]])
    grads = _grads(numel)
    for i, w in enumerate(arrivals):
        if lose is not None and i == lose[1]:
            services.worker_lost(lose[0], "killed by the test")
            time.sleep(0.3)   # the launcher's pipe is read between requests
        r = raw[w].ask({"op": "push", "worker": w, "step": 0, "version": 0, "offset": 0}, grads[w])
        assert r.op == "ack", r.header
    after = _fetch(raw[arrivals[-1]])
    summed = sorted(arrivals)
    # sgd, lr 0.5, the mean over the round's pushes (N, or fewer where a worker was lost without pushing)
    torch.testing.assert_close(after, before - 0.5 * _in_order(grads, summed) / len(summed))
    peak = services.finish()["memory"]["servers"][0]["early_pushes_peak"]
    return after, peak // (4 * numel)


def test_the_data_tells_orders_apart():
    """Guard: summed in these orders the gradients differ, so the tests below can see an arrival-order sum."""
    g = _grads(1000)
    assert not torch.equal(_in_order(g, [0, 1, 2, 3]), _in_order(g, [3, 1, 0, 2]))
    assert not torch.equal(_in_order(g, [1, 2, 3]), _in_order(g, [3, 2, 1]))


def test_a_sync_round_sums_in_worker_order_whatever_the_arrival_order(server):
    """...and keeps at most N - 1 pushes early (worker 0 last), none when they arrive in order."""
    reference, kept = _round(server, [0, 1, 2, 3])
    assert kept == 0
    for arrivals, most in (([3, 1, 0, 2], 2), ([2, 3, 1, 0], 3), ([1, 0, 3, 2], 1), ([3, 2, 1, 0], N - 1)):
        after, kept = _round(server, arrivals)
        assert torch.equal(after, reference), arrivals
        assert kept == most, arrivals


def test_a_worker_lost_without_pushing_does_not_stall_the_sum(server):
    """Workers 3 and 2 push early (kept), worker 0 is lost, worker 1 fills the gap: the round completes over
    1, 2, 3 summed in that order."""
    after, _ = _round(server, [3, 2, 1], lose=(0, 2))
    reference, _ = _round(server, [1, 2, 3], lose=(0, 0))
    assert torch.equal(after, reference)


def test_a_rounds_rows_sum_in_worker_order():
    cfg = from_dict(config("rows", base=ROWS_DLRM, train={"optimizer": "sgd", "lr": 0.5},
                           backend={"kind": "ps", "mode": "sync", "servers": 1, "world_size": 3,
                                    "embeddings": "rows"}))
    space = key_space(cfg)
    tables = torch.randn(space.total, space.dim, generator=torch.Generator().manual_seed(1))
    g = _grads(40 * space.dim)
    keys = [torch.arange(0, 40), torch.arange(10, 50), torch.arange(5, 45)]   # overlapping rows
    pushes = [(keys[w], g[w].view(40, space.dim)) for w in range(3)]
    out = []
    for arrivals in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        shard = RowShard(tables.clone(), space, 0, cfg)   # the shard owns (updates) the rows it is given
        for w in arrivals:
            shard.add_to_round(w, *pushes[w])
        shard.apply_round(1 / 3)
        out.append(shard.rows)
    assert all(torch.equal(o, out[0]) for o in out[1:])
    assert not torch.equal(out[0], tables)


@pytest.mark.parametrize("early", [True, False])
def test_a_refused_push_leaves_nothing_behind(server, early):
    """A push refused for inf/nan changes nothing. Early (worker 2, which is then lost): no kept copy is left to
    be summed or to stall the round; in order (worker 0, decoded into the accumulator): its valid push overwrites
    the half-written sum."""
    services, numel = server("sync", workers=3)
    addr = services.info.addresses[0]
    raw = {w: server.raw(addr, w) for w in range(3)}
    for w, r in raw.items():
        r.worker = w
    before = _fetch(raw[0])
    grads = _grads(numel)[:3]
    bad = 2 if early else 0
    poison = grads[bad].clone()
    poison[-1] = float("nan")
    push = {"op": "push", "step": 0, "version": 0, "offset": 0}
    r = raw[bad].ask(dict(push, worker=bad), poison)
    assert r.op == "error" and "inf/nan" in r.header["message"], r.header
    if early:
        services.worker_lost(2, "killed by the test")
        time.sleep(0.3)
    pushers = [1, 0] if early else [2, 1, 0]
    for w in pushers:
        r = raw[w].ask(dict(push, worker=w), grads[w])
        assert r.op == "ack", r.header
    torch.testing.assert_close(_fetch(raw[0]), before - 0.5 * _in_order(grads, sorted(pushers)) / len(pushers))
