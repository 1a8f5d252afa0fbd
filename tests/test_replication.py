"""Chain replication of the parameter servers (backend.replicas = r, psarch/ps/replication.py): tiny GPT runs on
loopback. Without faults r = 1 ends with r = 0's model and its replicas cost r x the servers' bytes, counted; a
server killed mid-run costs no acknowledged update (the same model, bit for bit, as the run without the fault);
with r = 0 a dead server still stops the run in one line; a worker killed mid-run is dropped from the same round by
every holder (its followers sum what its first holder summed); configs replication cannot serve are refused in one."""
from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import psarch
from parity import assert_same_model
from ps_setup import TINY_GPT, config, ps
from psarch.config import ConfigError, from_dict
from psarch.errors import RunError
from psarch.ps.errors import ServiceError
from psarch.ps.partitions import chain
from psarch.ps.replication import death, diverged, join_held, members_of, members_text
from psarch.ps.worker.client import PSClient
from psarch.workload import build_workload
from psarch.ps.services import LocalServers
from test_ps_faults import _children
from test_ps_server import server  # noqa: F401  (the fixture)
from timing import scaled

SGD = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "steps": 8}


def _cfg(name: str, backend: dict, fault: dict | None = None, **train):
    return from_dict(config(name, train=dict(SGD, **train), backend=backend, faults=fault or {}))


def _model(out: Path) -> dict:
    return torch.load(out / "model.pt", weights_only=True)


def _same(a: Path, b: Path, what: str) -> None:
    assert_same_model(_model(a), _model(b), what, rtol=0.0, atol=0.0)


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
    for bad in ("b", "x", "", "-1", "0"):   # "0": a round of no one, whose mean would divide by 0
        with pytest.raises(ValueError, match="expected a hexadecimal bit mask of some of workers 0..2"):
            members_of(bad, 3)


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


def _program_bytes(cfg, phi: float) -> tuple[dict[int, float], dict[int, float]]:
    """Bytes into and out of each node of cfg's step program written in full (a step, compute 0)."""
    from psarch import registry
    from psarch.theory.program import DataStep, Transfer

    into: dict[int, float] = {}
    out: dict[int, float] = {}
    for op in registry.spec_of(cfg).program(cfg, phi, DataStep(0.0, 0.0), False).ops:
        if isinstance(op, Transfer):
            into[op.dst] = into.get(op.dst, 0.0) + op.bytes
            out[op.src] = out.get(op.src, 0.0) + op.bytes
    return into, out


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
        assert out[w] == pytest.approx(predict(cfg, phi).worker.sent)
    assert sum(into[h] for h in holders) == pytest.approx(servers * predict(cfg, phi).server.received)


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

PARTITIONED = {"partition_mb": 0.01}   # partitions dealt round robin: none of a server's vectors is one range


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """The runs without faults several tests compare with, each run once for the module: (replicas, servers) ->
    (its folder, its summary); 2 workers, partitions dealt round robin, 8 steps of SGD with momentum."""
    runs: dict[tuple[int, int], tuple[Path, dict]] = {}

    def get(replicas: int, servers: int) -> tuple[Path, dict]:
        if (replicas, servers) not in runs:
            backend = dict(ps(2, servers=servers), **PARTITIONED, **({"replicas": replicas} if replicas else {}))
            out = tmp_path_factory.mktemp(f"r{replicas}-{servers}") / "run"
            runs[replicas, servers] = out, psarch.run(_cfg(f"r{replicas}", backend), out, echo=False)
        return runs[replicas, servers]
    return get


def test_r1_without_faults_ends_with_the_model_of_r0_and_its_bytes_are_r_times_the_servers(fault_free):
    """3 servers, partitions dealt round robin (each server holds its own and the previous server's)."""
    (r0, base), (r1, rep) = fault_free(0, 3), fault_free(1, 3)
    assert _children() == []
    assert rep["status"] == base["status"] == "finished" and "replication" not in base
    _same(r1, r0, "r = 1 vs r = 0")
    r = rep["replication"]
    assert r["copies_identical"] and r["dead_servers"] == []
    # the formula (theory.replication, r x the primaries' bytes of the same ops), exactly, in counted bytes
    assert r["received"] == r["formula_received"] == r["primary_received"] > 0
    assert r["sent"] == r["formula_sent"] == r["primary_sent"] > 0
    # and the primaries' bytes are r = 0's servers' on those ops: replication adds r x, nothing else
    ops = [s["ops"] for s in base["traffic"]["servers"]]
    assert r["primary_received"] == sum(o[k]["received"] for o in ops for k in ("pull", "pushpull") if k in o)
    # theory's (1 + r) x per server and per worker, payloads only: within the headers' share
    predicted = rep["predicted"]["traffic_per_step"]
    assert predicted["server_received"] == pytest.approx(2 * base["predicted"]["traffic_per_step"]["server_received"])


def test_rank_0_fetches_each_partition_from_its_first_holder_with_r0_and_r1_alike(tmp_path, monkeypatch):
    """The launcher's model.pt from the servers left out: model.pt is rank 0's fetch (partitions dealt round robin:
    none of a server's vectors is one range), the same with r = 1 as with r = 0."""
    monkeypatch.setattr(LocalServers, "_write_outputs", lambda self, out_dir, out, parts: None)
    backend = dict(ps(2, servers=3), **PARTITIONED)
    psarch.run(_cfg("r0", backend, steps=3), tmp_path / "r0", echo=False)
    psarch.run(_cfg("r1", dict(backend, replicas=1), steps=3), tmp_path / "r1", echo=False)
    _same(tmp_path / "r1", tmp_path / "r0", "rank 0's fetch, r = 1 vs r = 0")


def test_r1_pushed_after_backward_as_top_k_pairs_ends_with_the_model_of_r0(tmp_path):
    """A worker's top-k pairs (and their error feedback) are chosen once and sent to every holder."""
    backend = ps(2, servers=2, overlap_comm=False)
    train = {"compression": "topk", "topk_ratio": 0.25}
    psarch.run(_cfg("r0", backend, **train), tmp_path / "r0", echo=False)
    rep = psarch.run(_cfg("r1", dict(backend, replicas=1), **train), tmp_path / "r1", echo=False)
    assert rep["replication"]["copies_identical"] and rep["replication"]["received"] > 0
    _same(tmp_path / "r1", tmp_path / "r0", "top-k, r = 1 vs r = 0")


@pytest.mark.parametrize("servers, killed", [(2, 1), (3, 0)])
def test_a_server_killed_mid_run_with_r1_costs_no_update(tmp_path, fault_free, servers, killed):
    """Killed as step 3 of 8 begins (worker 0 holds there): its workers go on with its replica, and the run ends
    with the model of the run without the fault, bit for bit (SGD with momentum: the optimizer state too)."""
    backend = dict(ps(2, servers=servers, replicas=1, timeout_s=10.0), **PARTITIONED)
    plain, _ = fault_free(1, servers)
    out = tmp_path / "killed"
    summary = psarch.run(_cfg("killed", backend, {"kill": [{"node": f"server {killed}", "step": 3}]}), out,
                         echo=False)
    assert _children() == []
    assert summary["status"] == "finished" and summary["steps"] == 8 and summary["lost_workers"] == []
    assert summary["faults"][0]["node"] == f"server {killed}"
    [dead] = summary["replication"]["dead_servers"]
    assert dead == {"server": killed, "error": f"server {killed} died (exit code -9)"}
    assert summary["replication"]["copies_identical"]
    # its byte counters died with it: the formula is marked not applicable rather than compared with a part
    assert summary["replication"]["formula_received"] is None and summary["replication"]["formula_sent"] is None
    assert summary["replication"]["formula_note"].startswith(f"not applicable: server(s) {killed} died")
    assert [s["server"] for s in summary["traffic"]["servers"]] == [i for i in range(servers) if i != killed]
    _same(out, plain, "killed vs plain")
    # every worker went on without it: its connection dropped, then a round was served by the replica
    for f in summary["extra"]["failovers"]:
        assert [x["server"] for x in f] == [killed]
        assert f[0]["served_at"] >= f[0]["dropped_at"] >= summary["faults"][0]["at_unix"]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == list(range(8))


def test_a_server_paused_past_the_heartbeat_timeout_is_waited_for_not_abandoned(tmp_path):
    """SIGSTOP for 3 s with heartbeats of 0.5 / 1.5 s: with replicas no socket heartbeats, so only a process's
    death drops a connection; the paused server is waited for and its copies stay its replica's."""
    backend = ps(2, servers=2, replicas=1, timeout_s=30.0, heartbeat_s=0.5, heartbeat_timeout_s=1.5)
    summary = psarch.run(_cfg("paused", backend, {"pause": [{"node": "server 1", "step": 3, "seconds": 3}]}),
                         tmp_path / "paused", echo=False)
    assert _children() == []
    assert summary["status"] == "finished" and summary["faults"][0]["node"] == "server 1"
    assert summary["replication"]["dead_servers"] == [] and summary["replication"]["copies_identical"]
    assert summary["extra"]["failovers"] == [[], []]


def test_a_server_that_dies_as_its_stats_are_asked_for_is_a_dead_server_with_r1(tmp_path, monkeypatch, fault_free):
    """Killed as the launcher asks it for its final measurements (after every worker is done): with r = 1 the run
    ends with the live server's copy (the model of the run without the fault), that server dead in
    `replication.dead_servers`."""
    plain, _ = fault_free(1, 2)   # before the patch: the run without the fault asks its servers as usual
    send = LocalServers._send

    def _send(self, i, msg):
        if msg.get("cmd") == "stats" and i == 1:
            os.kill(self.workers[i].pid, signal.SIGKILL)
            self.workers[i].join(5)
        send(self, i, msg)
    monkeypatch.setattr(LocalServers, "_send", _send)
    backend = dict(ps(2, servers=2, replicas=1, timeout_s=10.0), **PARTITIONED)
    summary = psarch.run(_cfg("late", backend), tmp_path / "late", echo=False)
    assert _children() == []
    assert summary["status"] == "finished"
    assert summary["replication"]["dead_servers"] == [{"server": 1, "error": "server 1 died (exit code -9)"}]
    assert summary["replication"]["copies_identical"] and "model_from_servers_error" not in summary
    assert summary["replication"]["formula_received"] is None
    _same(tmp_path / "late", plain, "server 1 dead at the end vs plain")


def test_with_r0_a_killed_server_still_stops_the_run_in_one_line(tmp_path):
    with pytest.raises(ServiceError, match=r"^server 1 died \(exit code -9\)$"):
        psarch.run(_cfg("r0", ps(2, servers=2, timeout_s=3.0), {"kill": [{"node": "server 1", "step": 3}]}),
                   tmp_path / "r0", echo=False)
    assert _children() == []
    assert json.loads((tmp_path / "r0" / "summary.json").read_text())["error"] == "server 1 died (exit code -9)"


def test_when_every_holder_of_a_partition_is_dead_the_run_stops_in_one_line(tmp_path):
    """r = 1 over 2 servers: server 0 killed at step 3 (the run goes on with server 1), server 1 at step 5: server
    0's partitions have no holder left. The launcher names it, or a worker does, whichever sees it first."""
    out = tmp_path / "both"
    with pytest.raises(RunError, match=r"^server 1 died \(exit code -9\): server 0's partitions have no live holder "
                                       r"\(servers 0, 1 are dead; backend.replicas = 1\)$|^worker \d: (fetch: )?partition \[\d+, \d+\) has no "
                                       r"live holder \(servers 0, 1 are dead; backend.replicas = 1\)$"):
        psarch.run(_cfg("both", ps(2, servers=2, replicas=1, timeout_s=10.0),
                        {"kill": [{"node": "server 0", "step": 3}, {"node": "server 1", "step": 5}]}), out, echo=False)
    assert _children() == []
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "failed" and "\n" not in s["error"] and [f["node"] for f in s["faults"]] == ["server 0",
                                                                                                      "server 1"]


def dies_between_its_sends(cfg) -> psarch.Workload:
    """A tiny GPT whose worker 2 dies as it sends step 3's pushes: the first to reach a server (the copy for a
    partition's replica, sent first) arrives; the next (the same partition's, to its primary) is never sent."""
    sent = []
    post = PSClient.post

    def post_then_die(self, i, r):
        if self.worker == 2 and r.header["op"] == "pushpull" and r.header["step"] == 3:
            if sent:
                time.sleep(0.5)   # ZeroMQ sends the first push meanwhile
                os._exit(3)
            sent.append(i)
        post(self, i, r)
    PSClient.post = post_then_die
    return build_workload(from_dict(dict(TINY_GPT, train=cfg.to_dict()["train"])))


KILLED_AT_3 = ps(3, servers=2, timeout_s=scaled(2.0))   # each run waits it out once: the lost worker's drop


@pytest.fixture(scope="module")
def r0_killed_at_3(tmp_path_factory) -> Path:
    """The r = 0 run whose worker 2 of 3 is killed as step 3 begins: rounds 3 to 7 are workers 0 and 1's."""
    out = tmp_path_factory.mktemp("r0") / "r0"
    psarch.run(_cfg("r0", KILLED_AT_3, {"kill": [{"node": "worker 2", "step": 3}]}), out, echo=False)
    return out


@pytest.mark.parametrize("how", ["killed", "dies between its sends", "paused"])
def test_a_worker_lost_mid_run_is_dropped_from_the_same_round_by_every_holder(tmp_path, r0_killed_at_3, how):
    """Worker 2 of 3 with r = 1, lost at step 3: killed as the step begins; or dead as it sends step 3's pushes,
    after one of them reached a replica (the partition's primary never had it and sums round 3 over workers 0 and
    1; the replica, which has the dead worker's push, sums the same, as the survivors' `commit` says, and drops
    it); or stopped as the step begins for longer than backend.timeout_s (each partition's primary drops it on its
    own clock, its replica follows; back, it is refused and leaves: no re-admission with replicas). Each run
    finishes, its copies bit for bit equal, with the model of the r = 0 run whose worker 2 is killed as step 3
    begins (rounds 3 to 7 are workers 0 and 1's in both; SGD with momentum)."""
    backend = dict(KILLED_AT_3, replicas=1)
    t = KILLED_AT_3["timeout_s"]
    fault = {"killed": {"kill": [{"node": "worker 2", "step": 3}]}, "dies between its sends": {},
             "paused": {"pause": [{"node": "worker 2", "step": 3, "seconds": 1.7 * t}]}}[how]
    extra = {"workload": {"factory": "test_replication:dies_between_its_sends"}} if how == "dies between its sends" else {}
    cfg = from_dict(config("r1", train=SGD, backend=backend, faults=fault, **extra))
    summary = psarch.run(cfg, tmp_path / "r1", echo=False)
    assert _children() == []
    assert summary["status"] == "finished" and summary["steps"] == 8
    assert [w["rank"] for w in summary["lost_workers"]] == [2]
    assert summary["replication"]["copies_identical"] and summary["replication"]["dead_servers"] == []
    assert [d["version"] for d in summary["servers_detail"]] == [8, 8]
    assert [[d["from_round"] for d in s["drops"]] for s in summary["servers_detail"]] == [[3], [3]]
    _same(tmp_path / "r1", r0_killed_at_3, f"r = 1, worker 2 {how} at step 3, vs r = 0, killed as step 3 began")


def test_a_replica_sums_what_its_first_holder_summed_and_refuses_a_commit_that_differs(request):
    """Server 1 holds server 0's partition as its replica. Workers 0, 1 and 2 push it there; a commit naming workers
    0 and 1 (their first holder dropped worker 2) makes the round the mean of their two pushes, summed in worker
    order, worker 2's kept copy dropped; a commit naming no worker, a later commit naming other workers, a commit of
    a partition that is the server's own, and worker 2's push of the round that went on without it are refused; so
    is worker 2's commit of round 0 once round 1 went on without it too, as a lost worker's (it then leaves, as a
    worker that stalled past its drop does)."""
    from psarch.ps.layout import server_partitions
    start = request.getfixturevalue("server")   # test_ps_server's servers in threads, and raw peers
    services, numel = start("sync", workers=3, servers=2, replicas=1)
    cfg = from_dict(config("srv", workload={"model": "mlp"}, backend=ps(3, "sync", 2, replicas=1)))
    [(_, a)] = server_partitions(cfg, numel)[0]    # server 0's partition [0, a): server 1's replica
    raw = {w: start.raw(services.info.addresses[1], w) for w in range(3)}
    before = raw[0].ask({"op": "fetch", "worker": 0}).tensor().clone()
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(a, generator=g) * s for s in (1.0, 0.3, 3.0)]
    for w in (2, 1, 0):   # worker 2's first: each is kept until the round's members are known
        r = raw[w].ask({"op": "push", "worker": w, "step": 0, "version": 0, "offset": 0}, grads[w])
        assert r.op == "ack" and r.header["version"] == 0, r.header
    r = raw[0].ask({"op": "commit", "worker": 0, "step": 0, "offset": 0, "members": "0"})   # a round of no one
    assert r.op == "error" and "expected a hexadecimal bit mask of some of workers 0..2" in r.header["message"]
    r = raw[0].ask({"op": "commit", "worker": 0, "step": 0, "offset": 0, "members": members_text([0, 1])})
    assert r.op == "ack" and r.header["version"] == 1, r.header
    after = raw[0].ask({"op": "fetch", "worker": 0}).tensor()
    assert torch.equal(after[:a], before[:a] - 0.5 * (grads[0] + grads[1]) / 2)   # sgd, lr 0.5
    assert torch.equal(after[a:], before[a:])
    r = raw[1].ask({"op": "commit", "worker": 1, "step": 0, "offset": 0, "members": members_text([0, 1])})
    assert r.op == "ack", r.header    # the same round, said again by another worker
    r = raw[1].ask({"op": "commit", "worker": 1, "step": 0, "offset": 0, "members": members_text([0, 1, 2])})
    assert r.op == "error" and "its holders' copies diverged (this server's round sums workers [0, 1], the first " \
                               "live holder's summed workers [0, 1, 2])" in r.header["message"]
    r = raw[0].ask({"op": "commit", "worker": 0, "step": 0, "offset": a, "members": members_text([0, 1])})
    assert r.op == "error" and "the partition is this server's own" in r.header["message"]
    r = raw[2].ask({"op": "push", "worker": 2, "step": 0, "version": 0, "offset": 0}, grads[2])
    assert r.op == "error" and r.header["code"] == "lost" and "went on without it" in r.header["message"]
    for w in (0, 1):   # round 1 without worker 2; then worker 2, stalled since round 0, commits it: it leaves as lost
        r = raw[w].ask({"op": "push", "worker": w, "step": 1, "version": 0, "offset": 0}, grads[w])
        assert r.op == "ack", r.header
    r = raw[0].ask({"op": "commit", "worker": 0, "step": 1, "offset": 0, "members": members_text([0, 1])})
    assert r.op == "ack" and r.header["version"] == 2, r.header
    r = raw[2].ask({"op": "commit", "worker": 2, "step": 0, "offset": 0, "members": members_text([0, 1])})
    assert r.op == "error" and r.header["code"] == "lost" and "was dropped" in r.header["message"], r.header
