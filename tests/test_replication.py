"""Chain replication of the parameter servers (backend.replicas = r, psarch/ps/replication.py): tiny GPT runs on
loopback. Without faults r = 1 ends with r = 0's model and its replicas cost r x the servers' bytes, counted; a
server killed mid-run costs no acknowledged update (the same model, bit for bit, as the run without the fault);
with r = 0 a dead server still stops the run in one line; a replica sums what its first holder summed and refuses a
commit that differs. Workers lost or paused: test_replication_workers.py; without processes:
test_replication_chain.py."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

import psarch
from parity import assert_same_model
from ps_setup import config, ps
from psarch.config import from_dict
from psarch.errors import RunError
from psarch.ps import wire
from psarch.ps.errors import ServiceError
from psarch.ps.replication import members_text
from psarch.ps.services import LocalServers
from test_ps_faults import _children
from test_replication_chain import _cfg, _model
from timing import scaled


def _same(a: Path, b: Path, what: str) -> None:
    assert_same_model(_model(a), _model(b), what, rtol=0.0, atol=0.0)


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
    rep_cfg = _cfg("r1", dict(ps(2, servers=3), **PARTITIONED, replicas=1))   # as fault_free ran it
    assert _children() == []
    assert rep["status"] == base["status"] == "finished" and "replication" not in base
    _same(r1, r0, "r = 1 vs r = 0")
    r = rep["replication"]
    assert r["copies_identical"] and r["dead_servers"] == []
    # the formula (theory.replication, r x the primaries' bytes of the same ops), exactly, in counted bytes
    assert r["received"] == r["formula_received"] == r["primary_received"] > 0
    assert r["sent"] == r["formula_sent"] == r["primary_sent"] > 0
    # each worker's commits, as the step program sends them: one per step, partition and follower, and its ack;
    # each of messages.commit_bytes's and ack_bytes's bytes (the round summed every worker)
    from psarch.ps.layout import server_partitions
    from psarch.ps.messages import ack_bytes, commit_bytes
    starts = sorted(a for own in server_partitions(rep_cfg, rep["params"]) for a, _ in own)
    for w, per in enumerate(rep["traffic"]["per_rank"]):
        c = per["ops"]["commit"]
        assert c["calls"] == rep["steps"] * len(starts) * 1
        assert c["sent"] == sum(commit_bytes(2, step, a, w) for step in range(rep["steps"]) for a in starts)
        assert c["received"] == sum(ack_bytes(step + 1) for step in range(rep["steps"]) for _ in starts)
    # and the primaries' bytes are r = 0's servers' on those ops: replication adds r x, nothing else
    ops = [s["ops"] for s in base["traffic"]["servers"]]
    assert r["primary_received"] == sum(o[k]["received"] for o in ops for k in ("pull", "pushpull") if k in o)
    # theory's (1 + r) x per server and per worker, payloads only: within the headers' share
    predicted = rep["predicted"]["traffic_per_step"]
    assert predicted["server_received"] == pytest.approx(2 * base["predicted"]["traffic_per_step"]["server_received"])


def test_rank_0_fetches_each_partition_from_its_first_holder_with_r0_and_r1_alike(tmp_path, monkeypatch):
    """The launcher's model.pt from the servers left out: model.pt is rank 0's fetch (partitions dealt round robin:
    none of a server's vectors is one range), the same with r = 1 as with r = 0."""
    monkeypatch.setattr("psarch.ps.services.write_outputs", lambda cfg, out_dir, out, parts, live: None)
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
    """SIGSTOP for 1.5 s with heartbeats of 0.25 / 0.75 s (stopped twice their timeout): with replicas no socket
    heartbeats, so only a process's death drops a connection; the paused server is waited for and its copies stay
    its replica's."""
    backend = ps(2, servers=2, replicas=1, timeout_s=30.0, heartbeat_s=0.25, heartbeat_timeout_s=0.75)
    summary = psarch.run(_cfg("paused", backend, {"pause": [{"node": "server 1", "step": 3, "seconds": 1.5}]}),
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


def _follower(request, **backend):
    """Servers 0 and 1 (threads), r = 1, 3 workers: server 1 holds server 0's partition [0, a) as its replica. Returns
    (services, a, raw peers of workers 0..2 on server 1, push(w, step, op), commit(w, step, members))."""
    from psarch.ps.layout import server_partitions
    start = request.getfixturevalue("server")
    services, numel = start("sync", workers=3, servers=2, replicas=1, **backend)
    cfg = from_dict(config("srv", workload={"model": "mlp"}, backend=ps(3, "sync", 2, replicas=1)))
    [(_, a)] = server_partitions(cfg, numel)[0]
    raw = {w: start.raw(services.info.addresses[1], w) for w in range(3)}

    def push(w: int, step: int, op: str = "push", offset: int = 0) -> None:
        size = a if offset == 0 else numel - a
        raw[w].send({"op": op, "worker": w, "step": step, "version": 0, "offset": offset}, torch.ones(size))
        if op == "push":
            r = raw[w].reply()
            assert r is not None and r.op == "ack", r and r.header

    def commit(w: int, step: int, members) -> wire.Message:
        text = members if isinstance(members, str) else members_text(members)
        return raw[w].ask({"op": "commit", "worker": w, "step": step, "offset": 0, "members": text})
    return services, a, raw, push, commit


def test_a_replica_refuses_at_once_a_commit_naming_a_worker_that_cannot_push_the_round_here(request):
    """A commit naming a worker out of range, one whose pushes here stopped before the round before (a round went on
    without it and this server has not taken it back), or one that asked this server to rejoin at a later round (its
    earlier requests are all handled) is refused at once, in one line naming the worker and why; the refusal
    changes nothing (the right commit then completes the round)."""
    services, a, raw, push, commit = _follower(request)
    r = commit(0, 0, "8")
    assert r.op == "error" and r.header["message"] == (f"server 1: commit: partition [0, {a}) step 0: members '8' "
                                                       f"name worker 3: this run has workers 0..2"), r.header
    for w in range(3):
        push(w, 0)
    assert commit(0, 0, [0, 1, 2]).header["version"] == 1
    raw[2].send({"op": "rejoin", "worker": 2, "step": 3})   # held until round 3: worker 2 sends nothing meanwhile
    assert raw[2].reply(300) is None
    push(0, 1)
    push(1, 1)
    r = commit(0, 1, [0, 1, 2])
    assert r.op == "error" and r.header["message"] == (
        f"server 1: commit: partition [0, {a}) step 1: its first holder's round sums worker 2, which cannot push it "
        f"here (it asked this server to rejoin at round 3): the copies cannot agree"), r.header
    assert commit(1, 1, [0, 1]).header["version"] == 2   # refused, nothing changed: the round is still open
    push(0, 2)
    push(1, 2)
    r = commit(1, 2, [0, 1, 2])
    assert r.op == "error" and r.header["message"] == (
        f"server 1: commit: partition [0, {a}) step 2: its first holder's round sums worker 2, which cannot push it "
        f"here (its last push here was of step 0: a round went on without it, and this server has not taken it "
        f"back): the copies cannot agree"), r.header
    assert "\n" not in r.header["message"] and commit(0, 2, [0, 1]).header["version"] == 3


@pytest.mark.parametrize("how", ["died", "dropped", "live"])
def test_a_replica_that_waits_in_vain_for_a_push_names_the_worker_and_why(request, how):
    """A commit naming worker 2, which may still push (died as it sent, as far as this server knows; dropped from this
    server's own rounds on its clock, which a stopped worker comes back from; live) is waited for; after 2 x
    backend.timeout_s the replica stops, in one line naming worker 2 and what it knows of it."""
    services, a, raw, push, commit = _follower(request, timeout_s=0.5)
    why = {"died": "its process died (the launcher said so)",
           "dropped": "this server dropped it from its own rounds at round 0 (dead, hung or stopped)",
           "live": "it is live here, its push of the round not sent or still on its way"}[how]
    if how == "died":
        services.worker_lost(2, "killed by the test")
    if how == "dropped":   # server 1's own partition's round 0 waits backend.timeout_s for worker 2, then drops it
        push(1, 0, offset=a)
        push(0, 0, "pushpull", offset=a)   # answered when that round goes on without worker 2: its drop, seen
        r = raw[0].reply(int(scaled(10) * 1000))
        assert r is not None and r.op == "params" and r.header["version"] == 1 and r.header["offset"] == a, \
            r and r.header
    push(0, 0, "pushpull")   # its pull waits for the round
    push(1, 0)
    assert commit(1, 0, [0, 1, 2]).op == "ack"   # worker 2's push may still come
    r = raw[0].reply(8000)
    assert r is not None and r.op == "error", r and r.header
    assert r.header["message"] == (f"server 1: partition [0, {a}) step 0: its first holder summed pushes that never "
                                   f"reached this replica within 2 x backend.timeout_s = 1 s (worker 2: {why}): the "
                                   f"copies cannot agree"), r.header
