"""Chain replication of the parameter servers (backend.replicas = r, psarch/ps/replication.py) without processes:
each server's partitions held by the next r servers of the ring, when a dead server stops the run, a round's
members on the wire, holders whose rounds or copies differ, the step program's commits and their bytes against the
replication formula, and the configs replication cannot serve, refused in one line. The runs: test_replication.py."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ps_setup import config, ps
from psarch.config import ConfigError, from_dict
from psarch.ps import wire
from psarch.ps.partitions import chain
from psarch.ps.replication import death, diverged, join_held, members_of, members_text

SGD = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "steps": 8}


def _cfg(name: str, backend: dict, fault: dict | None = None, **train):
    return from_dict(config(name, train=dict(SGD, **train), backend=backend, faults=fault or {}))


def _model(out: Path) -> dict:
    return torch.load(out / "model.pt", weights_only=True)


# ------------------------------------------------------------------ the chain, without processes

def test_each_server_s_partitions_are_held_by_the_next_r_servers_of_the_ring():
    assert chain(3, 1, 2) == [2, 0] and chain(4, 2, 3) == [3, 0, 1] and chain(2, 0, 1) == [1]


def test_a_dead_server_stops_the_run_only_when_some_partition_has_no_live_holder():
    assert death(3, 0, set(), 1, "server 1 died") == "server 1 died"            # r = 0: the one line, as before
    assert death(3, 1, set(), 1, "server 1 died") is None                       # server 2 holds its partitions
    assert death(3, 1, {2}, 1, "server 1 died").startswith("server 1 died: server 1's partitions have no live "
                                                             "holder (servers 1, 2 are dead; backend.replicas = 1)")
    assert death(3, 2, {2}, 1, "server 1 died") is None


def test_a_round_s_members_travel_as_one_short_string():
    assert members_text([0, 1, 3]) == "b" and members_of("b", 4) == {0, 1, 3} and members_text([]) == "0"
    assert members_of(members_text(range(1000)), 1000) == set(range(1000))
    for bad in ("x", "", "-1", "0", "B"):   # "0": a round of no one, whose mean would divide by 0
        with pytest.raises(ValueError, match="expected a hexadecimal bit mask of some of workers 0..2"):
            members_of(bad, 3)
    with pytest.raises(ValueError, match=r"^members 'b' name worker 3: this run has workers 0..2$"):
        members_of("b", 3)


def test_holders_whose_rounds_differ_stop_the_run_in_one_line():
    """The safety net: replies of one exchange that name different rounds."""
    what = "worker 0: partition [0, 64)"
    assert diverged(what, [(0, {"version": 3, "summed": "3"}), (1, {"version": 3, "summed": "3"})]) is None
    split = diverged(what, [(0, {"version": 3, "summed": "3"}), (1, {"version": 3, "summed": "7"})])
    assert split == ("worker 0: partition [0, 64): its holders' copies diverged (server 0: version 3, workers [0, 1] "
                     "summed; server 1: version 3, workers [0, 1, 2] summed)")
    assert diverged(what, [(1, {"version": 4, "summed": "3"}), (2, {"version": 3, "summed": "3"})]) is not None


def test_copies_that_differ_are_found_when_the_model_is_joined():
    cfg = _cfg("join", ps(2, servers=2, replicas=1))
    helds = {0: torch.arange(6.0), 1: torch.arange(6.0)}    # tiny: each server holds the whole vector
    flat, same = join_held(cfg, helds, 6)
    assert same and torch.equal(flat, torch.arange(6.0))
    helds[1][4] = torch.nextafter(helds[1][4], torch.tensor(5.0))   # one ulp
    assert not join_held(cfg, helds, 6)[1]


def _transfers(cfg, phi: float) -> list:
    """The transfers of cfg's step program written in full (a step, compute 0)."""
    from psarch import registry
    from psarch.theory.program import DataStep, Transfer

    return [op for op in registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), False).ops
            if isinstance(op, Transfer)]


def _program_bytes(cfg, phi: float) -> tuple[dict[int, float], dict[int, float]]:
    """Bytes into and out of each node of cfg's step program written in full, its pushes and pulls (not the
    replicas' commits and their acks)."""
    into: dict[int, float] = {}
    out: dict[int, float] = {}
    for op in _transfers(cfg, phi):
        if not op.name.startswith(("commit.", "ack.")):
            into[op.dst] = into.get(op.dst, 0.0) + op.bytes
            out[op.src] = out.get(op.src, 0.0) + op.bytes
    return into, out


def test_a_commit_and_its_ack_cost_what_the_wire_sends():
    """messages.commit_bytes and ack_bytes (what the step program charges) against wire.encode of the header a worker
    sends (ServerLink, messages.commit_header) and the ack a server answers, at the edges of msgpack's int and str
    sizes."""
    from psarch.ps.messages import ack_bytes, commit_bytes, commit_header
    from psarch.ps.worker.resend import session
    rids = [session(), session() + 2**32 - 1, 1 << 32, (2**29 - 1 << 32) + 2**32 - 1]   # a session's first and last
    for (workers, step, offset, worker), rid in zip([(2, 0, 0, 1), (4, 127, 128, 3), (32, 255, 65_536, 31),
                                                     (200, 70_000, 2**32, 199), (1024, 10**6, 7, 1023)], rids * 2):
        header = dict(commit_header(step, offset, members_text(range(workers))), worker=worker, rid=rid)
        assert commit_bytes(workers, step, offset, worker) == wire.frames_bytes(wire.encode(header))
        assert wire.decode(wire.encode(header)).op == "commit"
    for version, rid in zip((0, 127, 128, 2**16, 2**40), rids * 2):
        assert ack_bytes(version) == wire.frames_bytes(wire.encode({"op": "ack", "version": version, "rid": rid}))


@pytest.mark.parametrize("colocated", [False, True])
def test_the_step_program_sends_each_follower_one_commit_per_partition_and_worker(colocated):
    """With r replicas each worker sends, per step, one commit to each of a partition's r other holders and takes one
    ack back, as ServerLink does (test_r1_without_faults counts them in a run), each of messages.commit_bytes's and
    ack_bytes's bytes (the run's largest commit: its last step and partition, its last worker)."""
    from psarch.ps.layout import server_partitions
    from psarch.ps.messages import ack_bytes, commit_bytes

    n, servers, r, phi = 4, 3, 2, 1e6
    placement = "colocated" if colocated else "dedicated"
    cfg = _cfg("r", dict(ps(n, servers=servers, replicas=r), partition_mb=0.05, server_placement=placement))
    parts = server_partitions(cfg, int(phi))
    count = sum(map(len, parts))
    ops = _transfers(cfg, phi)
    last = max(a for own in parts for a, _ in own)
    for kind, size in (("commit.", commit_bytes(n, SGD["steps"] - 1, last, n - 1)), ("ack.", ack_bytes(SGD["steps"]))):
        sent = [op for op in ops if op.name.startswith(kind)]
        # colocated: each of a partition's r followers has a worker beside it, whose commit crosses no link
        assert len(sent) == (n - colocated) * count * r and {op.bytes for op in sent} == {size}


@pytest.mark.parametrize("replicas, servers", [(1, 3), (2, 3), (1, 2)])
def test_the_step_program_moves_the_replication_formulas_bytes_on_every_link(replicas, servers):
    """psarch/ps/program.py's replicated step, from a config: each server receives and sends what the r = 0 servers
    whose partitions it holds (the chain) do, so the servers' links carry r x r = 0's on top (theory.replication, the
    formula counted in test_r1_without_faults...), and each worker (1 + r) x its r = 0 bytes each way."""
    from psarch.ps.theory import replication
    from psarch.theory import predict

    n, phi = 2, 1e6
    base = _cfg("r0", dict(ps(n, servers=servers), partition_mb=0.05))
    cfg = _cfg("r", dict(ps(n, servers=servers, replicas=replicas), partition_mb=0.05))
    (in0, out0), (into, out) = _program_bytes(base, phi), _program_bytes(cfg, phi)
    workers, holders = range(n), range(n, n + servers)   # dedicated servers: nodes n .. n + k - 1
    for i in range(servers):
        own = [h for h in range(servers) if i in chain(servers, replicas, h)]
        assert into[n + i] == pytest.approx(sum(in0[n + h] for h in own), rel=1e-12)
        assert out[n + i] == pytest.approx(sum(out0[n + h] for h in own), rel=1e-12)
    extra = replication(cfg, sum(in0[h] for h in holders), sum(out0[h] for h in holders))
    assert sum(into[h] for h in holders) - sum(in0[h] for h in holders) == pytest.approx(extra.received, rel=1e-12)
    assert sum(out[h] for h in holders) - sum(out0[h] for h in holders) == pytest.approx(extra.sent, rel=1e-12)
    for w in workers:
        assert out[w] == pytest.approx((1 + replicas) * out0[w]) and into[w] == pytest.approx((1 + replicas) * in0[w])
        assert out[w] == pytest.approx(predict(cfg, phi).link.sent)
    assert sum(into[h] for h in holders) == pytest.approx(servers * predict(cfg, phi).nodes["server"].link.received)


@pytest.mark.parametrize("placement", ["dedicated", "colocated"])
def test_a_replicated_run_gets_a_predicted_step_longer_than_without_replicas_on_a_slow_link(placement):
    """cluster_step (what an emulated run's report predicts with) plays the replicated program: a number, not nan, and
    on 100 Mbit/s links longer than r = 0's by at least the replicas' bytes on a server's link."""
    from psarch.theory import cluster_step

    def step(r: int) -> float:
        cfg = from_dict(config("slow", train=SGD, backend=dict(ps(4, servers=2, replicas=r, partition_mb=0.05,
                                                                   server_placement=placement)),
                               cluster={"link_mbps": 100.0}))
        got = cluster_step(cfg, {"params": 1e6, "step_time_s": 0.3, "comm_s": 0.2, "cluster": {"alpha_s": 1e-4}})
        return got["predicted_s"]

    r0, r1 = step(0), step(1)
    assert math.isfinite(r1) and r0 > 0.1
    # r = 1: each of the 2 servers also takes the other's N x S / 2 in (S = 4 MB), at 12.5 MB/s at most: half of it
    assert r1 > r0 + 0.5 * 4 * 4e6 / 2 / 12.5e6


@pytest.mark.parametrize("backend, train, error", [
    (ps(2, servers=2, replicas=2), {}, r"^backend.replicas = 2: must be less than backend.servers = 2"),
    (ps(2, servers=1, replicas=1), {}, r"^backend.replicas = 1: must be less than backend.servers = 1"),
    (ps(2, "async", servers=2, replicas=1), {}, r'^backend.replicas = 1: backend.mode = "async": replicas are kept '
                                                r'for "sync" only'),
    (ps(2, "geo", servers=2, replicas=1), {}, r'backend.mode = "geo": replicas are kept for "sync" only'),
    (ps(2, servers=2, replicas=1), {"checkpoint_every": 2}, r"^backend.replicas = 1: train.checkpoint_every = 2"),
    (ps(2, servers=2, replicas=1, priority_credit_mb=1.0), {}, r"^backend.replicas = 1: backend.priority_credit_mb"),
])
def test_configs_replication_cannot_serve_are_refused_in_one_line(backend, train, error):
    with pytest.raises(ConfigError, match=error) as e:
        _cfg("bad", backend, **train)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ runs
