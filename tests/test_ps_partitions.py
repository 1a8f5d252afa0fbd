"""Partitions of a server's range (backend.partition_mb), spoken to live servers (threads of the test process):
the arithmetic; sync rounds per partition bit-identical to unpartitioned servers whatever order partitions and
workers arrive in; a partition's pull answered as soon as its own round allows (the pipelining); each mode's
per-partition rules (async staleness per push, SSP's bound, GEO's rounds); requests about partitions that a
client would never send refused without changing anything; partitions dealt to the servers round robin.
(Priority's order of pushes and pulls: test_ps_priority.py.)"""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from psarch.config import from_dict
from psarch.ps.layout import (PARTITION_ALIGN, gather, held, join_servers, partition_elems, partitions, scatter,
                               server_partitions, server_ranges)
from psarch.ps.auth import Credentials
from psarch.ps.server.parameter_server import ParameterServer
from psarch.ps.services import start_services
from psarch.ps.worker.client import PSClient, Request
from psarch.workload import build_workload
from ps_setup import config, ps
from timing import scaled

PARTS = 0.001   # MiB: 256 fp32 elements per partition
# a small MLP (6,544 parameters): 26 partitions of PARTS, 13 per server of 2; the default one's 342 make every
# request-per-partition test a few thousand messages, not more checks
MLP = {"model": "mlp", "mlp": {"n_embd": 16, "hidden": 64}}


def test_partitions_split_each_range_at_aligned_offsets():
    assert partitions(10, 1010, 256) == [(10, 266), (266, 522), (522, 778), (778, 1010)]
    assert partitions(0, 100, 0) == [(0, 100)] and partitions(0, 100, 256) == [(0, 100)]

    def elems(mb: float, precision: str = "fp32") -> int:
        return partition_elems(from_dict(config("p", train={"precision": precision},
                                                backend=ps(1, partition_mb=mb))), 10**6)
    assert elems(PARTS) == 256 and elems(PARTS, "bf16") == 512 and elems(0.0) == 0
    assert elems(1e-9) == PARTITION_ALIGN and elems(0.00101) == 256   # rounded down to whole blocks, at least one
    assert elems(2.0) == 2**19 and elems(4.0) == 10**6   # 4 MiB holds more than the range: the range


def test_auto_partitions_pipeline_a_range_and_hide_the_host_cost_of_a_message():
    """"auto": a 16th of the widest range, at least 0.6 ms of an emulated cluster's link, at most 4 MiB (all
    of it where the link is not known)."""
    def elems(numel: int, servers: int = 1, link_mbps: float | None = None, precision: str = "fp32") -> int:
        cluster = {"emulate": True, "link_mbps": link_mbps} if link_mbps else {}
        cfg = from_dict(config("p", train={"precision": precision}, cluster=cluster,
                               backend=ps(servers, servers=servers, partition_mb="auto")))
        return partition_elems(cfg, numel)
    MiB = 2**20
    assert elems(64 * MiB) == MiB and elems(MiB) == MiB   # loopback, real networks: BytePS's 4 MB, in 4-byte elements
    assert elems(4 * MiB, precision="bf16") == 2 * MiB
    assert elems(MiB, precision="bf16") == MiB and elems(1000, servers=4) == 256   # never more than a range
    # 100 Mbit/s: 0.6 ms is 7.5 kB, so a 16th of the range sets it: 1.6 M parameters over 4 servers -> 24,960 (x 4 B)
    assert elems(1_600_000, servers=4, link_mbps=100.0) == 400_000 // 16 // PARTITION_ALIGN * PARTITION_ALIGN
    # 100 Gbit/s: 0.6 ms is 7.5 MB, over the 4 MiB cap
    assert elems(64 * MiB, link_mbps=100_000.0) == MiB
    # 10 Gbit/s: 0.6 ms is 750 kB (187,500 fp32 elements), more than a 16th of a 1 M range
    assert elems(1_000_000, link_mbps=10_000.0) == 187_500 // PARTITION_ALIGN * PARTITION_ALIGN


def test_round_robin_deals_the_partitions_to_the_servers_in_turn():
    """"round_robin" (BytePS): the flat vector's partitions from 0, partition j on server j mod k; "ranges": each
    server's contiguous range in partitions; either way a server's own vector scatters back into place; too few
    partitions to deal (none, partition_mb = 0, or none smaller than a range) is whole ranges."""
    def cfg(assignment: str, mb: float | str = PARTS, servers: int = 3):
        return from_dict(config("p", backend=ps(2, servers=servers, partition_mb=mb, partition_assignment=assignment)))
    dealt = server_partitions(cfg("round_robin"), 1300)   # 256-element partitions: 5 full, one of 20
    assert dealt == [[(0, 256), (768, 1024)], [(256, 512), (1024, 1280)], [(512, 768), (1280, 1300)]]
    assert server_partitions(cfg("ranges"), 1300) == [[(0, 256), (256, 433)], [(433, 689), (689, 866)],
                                                      [(866, 1122), (1122, 1300)]]
    flat = torch.arange(1300.0)
    assert torch.equal(join_servers(cfg("round_robin"), [gather(flat, parts) for parts in dealt]), flat)
    assert held(dealt[2]) == 276
    # partitions no smaller than a range (64 elements at least, of a range of 34): a range each, as "ranges"
    assert server_partitions(cfg("round_robin"), 100) == [[(0, 33)], [(33, 66)], [(66, 100)]]
    assert server_partitions(cfg("round_robin", 0.0), 1300) == [[(0, 433)], [(433, 866)], [(866, 1300)]]   # whole


class Run:
    """Servers of one config (threads) and a client per worker; partitions as (server, lo, hi) (each server's
    range unless the test deals them round robin)."""

    def __init__(self, mode: str, mb: float, workers: int = 2, servers: int = 1, train: dict | None = None,
                 **backend) -> None:
        backend.setdefault("partition_assignment", "ranges")
        cfg = from_dict(config("parts", workload=MLP,
                               train=train or {"optimizer": "sgd", "lr": 0.5},
                               backend=ps(workers, mode, servers, partition_mb=mb, **backend)))
        self.numel = sum(p.numel() for p in build_workload(cfg).model.parameters())
        self.services = start_services(cfg, None, threads=True)
        info = self.services.info
        self.clients = [PSClient(info.addresses, w, 10.0, info.auth) for w in range(workers)]
        self.servers = server_partitions(cfg, self.numel)
        self.parts = sorted(((i, a, b) for i, parts in enumerate(self.servers) for a, b in parts), key=lambda p: p[1])
        self.versions = [[0] * len(self.parts) for _ in range(workers)]

    def post(self, w: int, j: int, g: torch.Tensor, step: int, into: torch.Tensor) -> Request:
        """Worker w's pushpull of partition j (of flat gradient g) for `step`, its reply into `into`."""
        i, a, b = self.parts[j]
        r = Request({"op": "pushpull", "step": step, "version": self.versions[w][j], "offset": a}, g[a:b],
                    into=into[a:b])
        self.clients[w].post(i, r)
        return r

    def fetch(self) -> torch.Tensor:
        out, owns = torch.empty(self.numel), [torch.empty(held(parts)) for parts in self.servers]
        self.clients[0].exchange([[Request({"op": "fetch"}, into=own)] for own in owns])
        for parts, own in zip(self.servers, owns):
            scatter(own, parts, out)
        return out

    def close(self) -> dict:
        stats = self.services.finish()
        for c in self.clients:
            c.close()
        self.services.stop()
        return stats


@pytest.mark.parametrize("assignment", ["ranges", "round_robin"])
@pytest.mark.parametrize("train", [{"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
                                   {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}])
def test_sync_in_partitions_is_bit_identical_whatever_the_order(train, assignment):
    """3 workers, 2 servers, 3 steps: each worker posts its partitions in its own order (forward, backward,
    shuffled), the workers in turn 2, 0, 1 (so sums keep early pushes); the final parameters equal, bit for bit,
    those of servers holding each range whole and fed in order (partitions in each server's range, or dealt to
    the servers round robin)."""
    gen = torch.Generator().manual_seed(0)
    finals = {}
    for mb in (0.0, PARTS):
        run = Run("sync", mb, workers=3, servers=2, train=train, partition_assignment=assignment if mb else "ranges")
        try:
            assert (len(run.parts) > 4) == bool(mb)
            if mb and assignment == "round_robin":   # server 0 holds partitions 0, 2, 4, ...: not one range
                assert [p[1] for p in run.parts[::2]] == [a for a, _ in run.servers[0]]
            grads = [[torch.randn(run.numel, generator=gen.manual_seed(10 * s + w)) for w in range(3)]
                     for s in range(3)]
            for step in range(3):
                into = [torch.empty(run.numel) for _ in range(3)]
                order = list(range(len(run.parts)))
                orders = {0: order, 1: order[::-1], 2: random.Random(step).sample(order, len(order))}
                reqs = {w: [run.post(w, j, grads[step][w], step, into[w]) for j in orders[w]] for w in (2, 0, 1)}
                for w in range(3):
                    run.clients[w].wait()
                    run.versions[w] = [None] * len(run.parts)
                    for j, r in zip(orders[w], reqs[w]):
                        run.versions[w][j] = r.reply["version"]
                assert all(v == [step + 1] * len(run.parts) for v in run.versions)
                assert torch.equal(into[0], into[1]) and torch.equal(into[0], into[2])
            finals[mb] = run.fetch()
        finally:
            run.close()
    assert torch.equal(finals[0.0], finals[PARTS]), "partitioned sync differs from whole ranges"


def test_a_partition_is_answered_once_its_own_round_is_complete():
    """sync: both workers push partition 0; worker 0's pull of it is answered while partition 1 has not been
    pushed by anyone (what lets a worker receive partition p while it sends p + 1)."""
    run = Run("sync", PARTS)
    try:
        g = [torch.randn(run.numel) for _ in range(2)]
        into = torch.empty(run.numel)
        first = run.post(0, 0, g[0], 0, into)
        run.post(1, 0, g[1], 0, torch.empty(run.numel))
        run.clients[0].wait(until=first)
        assert first.answered and first.reply["version"] == 1
        assert len(run.clients[0].waiting[0]) == 0 and len(run.clients[1].waiting[0]) == 1
        rest = [run.post(0, j, g[0], 0, into) for j in range(1, len(run.parts))]
        assert not any(r.answered for r in rest)
        for j in range(1, len(run.parts)):
            run.post(1, j, g[1], 0, torch.empty(run.numel))
        for c in run.clients:
            c.wait()
        assert all(r.reply["version"] == 1 for r in rest)
    finally:
        run.close()


def test_async_applies_each_partition_as_it_arrives_and_counts_staleness_per_push():
    """Worker 0 pushes partition 1; worker 1 (it pulled version 0 of both) pushes partition 0, fresh, then 1,
    stale by worker 0's push; worker 0's push of partition 0 is then stale by worker 1's. Each partition counts
    its own updates, and the histogram counts pushes of partitions."""
    run = Run("async", PARTS)
    try:
        assert len(run.parts) >= 2
        g, sink = torch.ones(run.numel), torch.empty(run.numel)
        acks = []
        for w, j in ((0, 1), (1, 0), (1, 1), (0, 0)):
            r = run.post(w, j, g, 0, sink)
            run.clients[w].wait()
            acks.append((w, j, r.reply["staleness"], r.reply["version"]))
        assert acks == [(0, 1, 0, 1), (1, 0, 0, 1), (1, 1, 1, 2), (0, 0, 1, 2)]
    finally:
        stats = run.close()
    assert stats["staleness"]["histogram"] == {"0": 2, "1": 2}
    assert stats["staleness"]["counted"] == "per update of one partition"


def test_ssp_bounds_each_partition_by_its_own_slowest_worker():
    """staleness_bound 0: worker 0's pulls of step 1 wait for worker 1's push of the same partition; worker 1
    pushing partition 1 frees that pull while partition 0's still waits."""
    run = Run("ssp", PARTS, staleness_bound=0)
    try:
        g, into = torch.ones(run.numel), torch.empty(run.numel)
        r0, r1 = run.post(0, 0, g, 0, into), run.post(0, 1, g, 0, into)
        run.clients[1].exchange([[Request({"op": "push", "step": 0, "version": 0, "offset": run.parts[1][1]},
                                          g[run.parts[1][1]:run.parts[1][2]])]])
        run.clients[0].wait(until=r1)
        assert r1.answered and r1.reply["ahead"] == 0 and not r0.answered
        run.clients[1].exchange([[Request({"op": "push", "step": 0, "version": 0, "offset": 0},
                                          g[:run.parts[0][2]])]])
        run.clients[0].wait()
        assert r0.answered
    finally:
        run.close()


@pytest.mark.parametrize("barrier", [False, True])
def test_geo_adds_each_partitions_deltas(barrier):
    """GEO: each partition adds the deltas pushed to it (with the barrier, once its round is complete: partition
    1's round ends while partition 0 still waits for worker 1)."""
    run = Run("geo", PARTS, geo_barrier=barrier)
    try:
        before = run.fetch()
        d = [torch.randn(run.numel) for _ in range(2)]
        sink = torch.empty(run.numel)
        reqs = {(w, j): run.post(w, j, d[w], 0, sink) for w in (0, 1) for j in range(len(run.parts)) if (w, j) != (1, 0)}
        run.clients[0].wait(until=reqs[(0, 1)])
        assert reqs[(0, 1)].answered and (barrier != reqs[(0, 0)].answered)
        run.post(1, 0, d[1], 0, sink)
        for c in run.clients:
            c.wait()
        torch.testing.assert_close(run.fetch(), before + d[0] + d[1])
    finally:
        run.close()


def test_requests_about_partitions_a_client_would_never_send_are_refused():
    """A push at an offset inside a partition, a push of a whole range, a pull of a partition another server
    holds, a second push or waiting pull of the same partition, a non-finite partition: each refused, the
    parameters unchanged; the other partitions' requests go on."""
    run = Run("sync", PARTS, servers=2)
    info = run.services.info
    c = PSClient(info.addresses, 0, 10.0, info.auth)   # worker 0 again: its refused requests leave run's alone
    try:
        before = run.fetch()
        (i0, a0, b0), (i1, a1, _) = run.parts[0], run.parts[-1]
        assert i0 == 0 and i1 == 1
        g = torch.ones(run.numel)
        bad = torch.ones(b0 - a0)
        bad[3] = float("nan")
        refused = [
            (0, {"op": "push", "step": 0, "version": 0, "offset": a0 + 64}, g[:b0 - a0], "starts none"),
            (0, {"op": "push", "step": 0, "version": 0, "offset": 0}, g[:server_ranges(run.numel, 2)[0][1]],
             "the partition there is"),
            (0, {"op": "pull", "step": 0, "want": "float32", "offset": a1}, None, "starts none"),
            (0, {"op": "push", "step": 0, "version": 0, "offset": a0}, bad, "inf/nan"),
        ]
        for server, header, tensor, says in refused:
            with pytest.raises(Exception, match=says):
                c.exchange([[Request(header, tensor)] if i == server else [] for i in range(2)])
        assert torch.equal(run.fetch(), before)
        first = run.post(0, 0, g, 0, torch.empty(run.numel))
        run.post(0, 1, g, 0, torch.empty(run.numel))   # another partition: its pull waits beside the first's
        for header, tensor, says in [({"op": "pull", "step": 1, "want": "float32", "offset": a0}, None,
                                      "already has a pull waiting"),
                                     ({"op": "push", "step": 0, "version": 0, "offset": a0}, g[a0:b0],
                                      "already pushed step 0")]:
            # `c` is another connection: until the server has taken run's push (in flight on its own connection),
            # the same request is refused for coming before it ("has pushed 0 step(s)"); refused either way
            deadline = time.monotonic() + scaled(10)
            while True:
                with pytest.raises(Exception) as refusal:
                    c.exchange([[Request(header, tensor)], []])
                if says in str(refusal.value) or time.monotonic() > deadline:
                    break
                assert "has pushed 0 step(s)" in str(refusal.value), refusal.value
                time.sleep(0.05)
            assert says in str(refusal.value), refusal.value
        for j in range(len(run.parts)):
            run.post(1, j, g, 0, torch.empty(run.numel))
            if j >= 2:
                run.post(0, j, g, 0, torch.empty(run.numel))
        for cl in run.clients:
            cl.wait()
        assert first.reply["version"] == 1
        torch.testing.assert_close(run.fetch(), before - 0.5 * g)
    finally:
        c.close()
        stats = run.close()
    assert stats["refused_pushes"]["non_finite_per_worker"] == [1, 0]


def test_a_server_with_partitions_dealt_round_robin_takes_only_its_own():
    """Two servers, partitions dealt in turn: server 0 refuses a push of server 1's partition (naming what it
    holds) and changes nothing; a round of every partition from both workers moves every element by -lr x g."""
    run = Run("sync", PARTS, servers=2, partition_assignment="round_robin")
    try:
        before, g = run.fetch(), torch.ones(run.numel)
        (i1, a1, b1) = run.parts[1]
        assert (run.parts[0][0], i1) == (0, 1)
        with pytest.raises(Exception, match=rf"offset {a1} starts none of this server's .* dealt round robin"):
            run.clients[0].exchange([[Request({"op": "push", "step": 0, "version": 0, "offset": a1}, g[a1:b1])], []])
        assert torch.equal(run.fetch(), before)
        reqs = [run.post(w, j, g, 0, torch.empty(run.numel)) for w in (0, 1) for j in range(len(run.parts))]
        for c in run.clients:
            c.wait()
        assert {r.reply["version"] for r in reqs} == {1}
        torch.testing.assert_close(run.fetch(), before - 0.5 * g)
    finally:
        run.close()


def test_a_server_started_without_parameters_takes_its_dealt_partitions_from_init():
    """Server 1 of 2, partitions dealt round robin, started without parameters (as `psarch server` and the
    benchmark's are): an `init` of its would-be contiguous range is refused naming what it holds; its own
    vector (partitions 1, 3, 5, ... joined) is taken, and `fetch` gives it back."""
    cfg = from_dict(config("p", train={"optimizer": "sgd", "lr": 0.5},
                           backend=ps(2, servers=2, partition_mb=PARTS, partition_assignment="round_robin",
                                      auth="none")))
    numel = 2000
    parts = server_partitions(cfg, numel)[1]
    srv = ParameterServer(1, cfg, creds=Credentials("none"), numel=numel)
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    client = PSClient([srv.address, srv.address], 0, 10.0, {"mechanism": "none"})
    try:
        flat = torch.arange(float(numel))
        lo, hi = server_ranges(numel, 2)[1]
        with pytest.raises(Exception, match=rf"this server holds {len(parts)} partition\(s\), {held(parts)} elements"):
            client.exchange([[], [Request({"op": "init", "numel": numel, "offset": lo}, flat[lo:hi])]])
        own = gather(flat, parts)
        client.exchange([[], [Request({"op": "init", "numel": numel, "offset": parts[0][0]}, own)]])
        got = torch.empty(held(parts))
        client.exchange([[], [Request({"op": "fetch"}, into=got)]])
        assert torch.equal(got, own) and [(p.lo, p.hi) for p in srv.state.parts] == parts
    finally:
        client.close()
        srv.stop()
        thread.join(5)
