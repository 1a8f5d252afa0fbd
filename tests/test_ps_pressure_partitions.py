"""The parameter server under pressure with partitions (backend.partition_mb): each partition's update, each
partitioned round and its embedding rows are checked finite before anything is applied, and the default bound
on what one connection may have in flight holds a partitioned exchange (psarch/ps/server/connections.py)."""
from __future__ import annotations

import threading
import time

import torch
import zmq

from psarch.config import from_dict
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from ps_setup import config, ps
from test_ps_pressure import MiB, Dealer
from timing import scaled

PARTITION_64 = 64 * 4 / MiB   # backend.partition_mb of the smallest partitions, 64 fp32 elements


def test_a_partition_whose_update_would_be_non_finite_is_refused(serve):
    """With partitions each partition's update is checked before it is applied: pushes of 3e38 to one partition
    are refused once its update would overflow, and neither it nor any other partition changes."""
    srv = serve("async", partition_mb=PARTITION_64)
    s = srv.state
    assert len(s.parts) > 2
    part, start = s.parts[1], s.params().clone()
    zctx = zmq.Context()
    try:
        w1 = Dealer(zctx, srv.address, srv.creds, 1)
        huge, refused = torch.full((part.hi - part.lo,), 3e38), None
        for step in range(12):
            before = part.range.params.detach().clone()
            r = w1.ask({"op": "push", "worker": 1, "step": step, "version": 0, "offset": part.lo}, huge)
            if r.op == "error":
                refused = r
                break
            assert r.op == "ack", r.header
        assert refused is not None, "12 pushes of 3e38 to one partition accepted"
        assert refused.header.get("code") == "non_finite", refused.header
        assert torch.equal(part.range.params.detach(), before), "a refused update changed its partition"
        now = s.params()
        others = torch.ones_like(now, dtype=torch.bool)
        at = part.lo - s.parts[0].lo   # this server's range is contiguous: its own vector is the flat slice
        others[at:at + part.hi - part.lo] = False
        assert torch.equal(now[others], start[others]), "another partition changed"
        assert s.refused_non_finite == [0, 1] and s.failure is None
    finally:
        zctx.destroy(linger=0)


def test_a_partition_round_whose_update_would_be_non_finite_fails_the_server_unapplied(serve):
    """Sync with partitions: partition 0's round is applied as soon as it is complete; partition 1's round, whose
    sum would make its update non-finite, is not applied, and the server fails naming the partition."""
    srv = serve("sync", partition_mb=PARTITION_64)
    s = srv.state
    p0, p1 = s.parts[0], s.parts[1]
    zctx = zmq.Context()
    try:
        dealers = [Dealer(zctx, srv.address, srv.creds, w) for w in (0, 1)]
        for w, d in enumerate(dealers):
            r = d.ask({"op": "push", "worker": w, "step": 0, "version": 0, "offset": p0.lo}, torch.ones(p0.hi - p0.lo))
            assert r is not None and r.op == "ack", r
        deadline = time.monotonic() + scaled(5)
        while p0.range.version == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p0.range.version == 1 and s.failure is None
        before = p1.range.params.detach().clone()
        for w, d in enumerate(dealers):
            r = d.ask({"op": "push", "worker": w, "step": 0, "version": 0, "offset": p1.lo},
                      torch.full((p1.hi - p1.lo,), 3e38))
            assert r is not None
        deadline = time.monotonic() + scaled(5)
        while s.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.failure is not None and "non-finite" in s.failure, s.failure
        assert f"partition [{p1.lo}, {p1.hi})" in s.failure, s.failure
        assert torch.equal(p1.range.params.detach(), before) and p1.range.version == 0
    finally:
        zctx.destroy(linger=0)


def test_a_sync_round_whose_rows_would_be_non_finite_fails_unapplied_with_partitions(tmp_path):
    """Sync with embedding rows and the dense part in partitions: the round's rows go with the first partition to
    complete it and are checked before anything is stored; rows whose row-wise Adagrad update would overflow
    fail the server, and neither the rows nor any partition change."""
    from psarch.ps.server.start import build_server
    keys = auth.keygen(tmp_path / "keys", 2, 1)
    cfg = from_dict(config("rowround", base={"seed": 1, "workload": {
        "model": "dlrm", "data": "clicks", "dlrm": {"num_tables": 2, "rows": 50, "dim": 4, "bottom_mlp": [32],
                                                     "top_mlp": [32]}, "clicks": {"dense": 3}},
        "train": {"steps": 1, "global_batch": 4}}, train={"optimizer": "adagrad", "lr": 0.5},
        backend=ps(2, "sync", embeddings="rows", partition_mb=PARTITION_64, auth="plain", keys=str(keys))))
    srv = build_server(0, cfg, "127.0.0.1", 0, True, creds=Credentials("plain", str(keys)))
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    s, zctx = srv.state, zmq.Context()
    try:
        assert len(s.parts) >= 2
        rows, dense = srv.rows.shard.rows.clone(), s.params().clone()
        dealers = [Dealer(zctx, srv.address, srv.creds, w) for w in (0, 1)]
        for w, d in enumerate(dealers):
            d.sock.send_multipart(wire.encode({"op": "rowpush", "worker": w, "step": 0, "version": 0},
                                              torch.full((2, 4), 1e20), keys=torch.tensor([0, 6])))
            assert wire.decode(d.sock.recv_multipart()).op == "ack"
        p0 = s.parts[0]
        for w, d in enumerate(dealers):
            r = d.ask({"op": "push", "worker": w, "step": 0, "version": 0, "offset": p0.lo}, torch.ones(p0.hi - p0.lo))
            assert r is not None and r.op == "ack", r
        deadline = time.monotonic() + scaled(5)
        while s.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.failure is not None and "non-finite" in s.failure and "not applied" in s.failure, s.failure
        assert torch.equal(srv.rows.shard.rows, rows) and torch.equal(s.params(), dense)
        assert all(p.range.version == 0 for p in s.parts)
    finally:
        zctx.destroy(linger=0)
        srv.stop()
        thread.join(5)


def test_the_default_budget_holds_two_partitioned_exchanges():
    """With partitions a worker's exchange with a server is one message per partition each way, back to back; the
    default bound (inflight_mb = 0) must let two such exchanges be in flight, every message with its header and
    its frames' framing. Counting two headers an exchange, as before partitions, a server of 2^20 elements in
    64-element partitions held 9.25 MiB of budget against 15.5 MiB of two exchanges of its own workers' pushes."""
    from psarch.ps.layout import partitions
    from psarch.ps.server.tcp_bytes import exchange_budget, framing
    n, big = 2**20, 10**6
    flat, parts = torch.zeros(n), partitions(0, n, 64)

    def size(header: dict, tensor: torch.Tensor | None = None) -> int:
        frames = wire.encode(header, tensor)
        return wire.frames_bytes(frames) + sum(framing(len(f), curve=True) for f in frames)   # CURVE's, the most

    rid = 1 << 61   # the largest request id a worker sends (psarch/ps/worker/resend.py)
    pushes = sum(size({"op": "pushpull", "worker": 7, "step": big, "version": big, "offset": a, "scale": 65536.0,
                       "found_inf": False, "rid": rid}, flat[a:b]) for a, b in parts)
    replies = sum(size({"op": "ack", "version": big, "staleness": 3, "ahead": 2, "scale": 65536.0, "skipped": False,
                        "rid": rid})
                  + size({"op": "params", "version": big, "offset": a, "staleness": 3, "ahead": 2, "scale": 65536.0,
                          "skipped": False, "rid": rid}, flat[a:b]) for a, b in parts)
    budget = exchange_budget(n, len(parts), 0, wire.MAX_HEADER)
    assert 2 * pushes <= budget and 2 * replies <= budget, (pushes, replies, budget)
    assert exchange_budget(n, 1, 0, wire.MAX_HEADER) < 2 * (4 * n + 2 * wire.MAX_HEADER + 4096) + MiB   # whole
