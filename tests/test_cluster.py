"""The emulated cluster itself: preflight errors, the plan of nodes, real shaping and link counters."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from cluster_setup import leftovers, needs_root
from psarch.cluster import netns
from psarch.cluster.emulated import EmulatedCluster, plan
from psarch.cluster.preflight import missing
from psarch.config import ConfigError, check_machine, from_dict


def test_preflight_names_what_is_missing(tmp_path, monkeypatch):
    for kwargs, what in [({"ip": "psarch-no-such-ip"}, "`psarch-no-such-ip` (iproute2) is not installed"),
                            ({"tc": str(tmp_path / "tc")}, "(iproute2) is not installed"),
                            ({"capability": 63}, "needs root (capability 63")]:
        msg = missing(**kwargs)
        assert msg is not None and what in msg and "--set cluster.emulate=false" in msg and "\n" not in msg
    # psarch run calls it through check_machine, before any process starts
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="cluster.emulate = true: `ip` .* not installed"):
        check_machine(from_dict({"cluster": {"emulate": True}}))
    check_machine(from_dict({"cluster": {"emulate": False}}))   # the default needs nothing


def test_cluster_keys_are_checked():
    with pytest.raises(ConfigError, match=r"cluster.slow_workers = \[2\]: expected distinct worker ranks in 0..1"):
        from_dict({"backend": {"kind": "ddp", "world_size": 2}, "cluster": {"slow_workers": [2]}})
    with pytest.raises(ConfigError, match=r"cluster.slow_workers = \[0, 0\]"):
        from_dict({"backend": {"kind": "ddp", "world_size": 2}, "cluster": {"slow_workers": [0, 0]}})
    with pytest.raises(ConfigError, match="cluster.slowdown = 0.5: must be >= 1"):
        from_dict({"cluster": {"slowdown": 0.5}})
    with pytest.raises(ConfigError, match="cluster.link_mbps = 0.0: must be >= 0.001"):
        from_dict({"cluster": {"link_mbps": 0.0}})


def test_plan_names_addresses_and_rates():
    nodes = plan(42, 3, 2, 100.0, from_dict({"backend": {"kind": "ps"}, "cluster": {"link_mbps": 100.0}}).cluster.server_mbps)
    assert [n.ns for n in nodes] == [f"psarch-42-{x}" for x in ("w0", "w1", "w2", "s0", "s1")]
    assert len({n.address for n in nodes}) == 5 and all(n.address.startswith("10.213.") for n in nodes)
    assert [n.mbps for n in nodes] == [100.0] * 5                 # server_link_mbps = 0: same as link_mbps
    assert [n.mbps for n in plan(42, 1, 1, 100.0, 400.0)] == [100.0, 400.0]
    with pytest.raises(ValueError, match="at most 250 workers"):
        plan(42, 251, 0, 100.0, 100.0)


def _serve(ns: str, ready: threading.Event, port: list, got: list) -> None:
    with netns.inside(ns):
        srv = socket.create_server(("0.0.0.0", 0))
    port.append(srv.getsockname()[1])
    ready.set()
    conn, _ = srv.accept()
    n = 0
    while chunk := conn.recv(1 << 16):
        n += len(chunk)
    got.append((n, time.perf_counter()))
    conn.close()
    srv.close()


@needs_root
def test_shaping_is_real_and_counted():
    """X bytes between two nodes at L Mbit/s take at least X*8/L seconds and not much more; the link
    counters see them, plus TCP/IP headers (about 5% at 1500-byte frames)."""
    mbps, size = 20.0, 2_500_000            # 1.0 s at the link rate
    c = EmulatedCluster(2, 0, mbps, mbps)
    try:
        ready, port, got = threading.Event(), [], []
        t = threading.Thread(target=_serve, args=(c.nodes[1].ns, ready, port, got), daemon=True)
        t.start()
        ready.wait(10)
        before = c.counters()
        with netns.inside(c.nodes[0].ns):
            s = socket.create_connection((c.nodes[1].address, port[0]), timeout=30)
        t0 = time.perf_counter()
        s.sendall(os.urandom(size))
        s.close()
        t.join(30)
        n, t1 = got[0]
        after = c.counters()
    finally:
        c.close()
    ideal = size * 8 / (mbps * 1e6)
    assert n == size
    assert ideal * 0.97 <= t1 - t0 <= ideal * 1.3 + 0.2, (t1 - t0, ideal)
    sent = after[c.nodes[0].ns][0] - before[c.nodes[0].ns][0]
    received = after[c.nodes[1].ns][1] - before[c.nodes[1].ns][1]
    assert size < sent < size * 1.08 and size < received < size * 1.08, (sent, received)
    assert not leftovers(os.getpid())


def test_cluster_step_time_by_hand():
    """S = 1 MB (250,000 fp32 parameters), N = 4, 100 Mbit/s (12.5 MB/s of frames, 1448/1514 of it
    payload), α = 0.1 ms, compute 50 ms, counted by hand."""
    from psarch.theory import cluster_step_time, config_for, predict

    def step(kind: str, stage: int = 1, servers: int = 1, placement: str = "dedicated", **kw) -> float:
        options = {"zero": {"stage": stage},
                   "ps": {"servers": servers, "partition_mb": 0.0, "server_placement": placement}}.get(kind, {})
        p = predict(config_for(kind, 1 if kind == "single" else 4, "fp32", "sgd", **options), 250_000)
        return cluster_step_time(p, 0.05, 100.0, kw.pop("server_mbps", 100.0), alpha_s=1e-4, **kw)["step_time_s"]

    rate = 12.5e6 * 1448 / 1514           # payload bytes/s
    assert step("ddp") == pytest.approx(0.05 + 1.5e6 / rate + 6e-4)             # ring: 2(N-1)/N·S, 2(N-1) hops
    assert step("zero", stage=3) == pytest.approx(0.05 + 2.25e6 / rate + 9e-4)  # 3(N-1)/N·S, 3(N-1) hops
    assert step("zero", stage=3, hidden_passes=2) == pytest.approx(0.05 + 0.75e6 / rate + 3e-4)
    assert step("ps") == pytest.approx(0.05 + 2 * 4e6 / rate + 2e-4)           # one server's link: N·S each way
    assert step("ps", servers=4) == pytest.approx(0.05 + 2 * 1e6 / rate + 2e-4)  # N servers: S each
    assert step("ps", server_mbps=400.0) == pytest.approx(0.05 + 2 * 4e6 / (4 * rate) + 2e-4)
    # pipelined over m partitions per server: (push + pull) / m to fill and drain, (m - 1) / m of both at once
    for m in (1, 4, 25):
        assert step("ps", servers=4, pipeline=m) == pytest.approx(0.05 + (2 / m + (m - 1) / m) * 1e6 / rate + 2e-4)
        assert step("ps", pipeline=m) == pytest.approx(0.05 + (1 + 1 / m) * 4e6 / rate + 2e-4)
    # colocated, server i on worker i's node: 3/4 S of pushes out and 3/4 S in, then the same of pulls; pipelining
    # cannot help a node already busy both ways
    for m in (1, 25):
        assert step("ps", servers=4, placement="colocated", pipeline=m) == pytest.approx(0.05 + 1.5e6 / rate + 2e-4)
    # 2 servers beside workers 0 and 1: their nodes push S/2, receive 3/2 S; the workers alone push S
    assert step("ps", servers=2, placement="colocated") == pytest.approx(0.05 + 2 * 1.5e6 / rate + 2e-4)
    assert step("single") == 0.05
    # overlap: 4 buckets ready at 1/4, 2/4, 3/4 and the end of backward (2/3 of compute, or as given) on one
    # link: link-bound, it starts at 1/4 of backward and runs all of comm; compute-bound, the last bucket waits
    comm = 1.5e6 / rate + 6e-4
    assert step("ddp", buckets=4, overlap=True) == pytest.approx(0.05 + comm - 0.05 * 2 / 3 * 3 / 4)
    assert step("ddp", buckets=4, overlap=True, backward_s=0.02) == pytest.approx(0.05 + comm - 0.02 * 3 / 4)
    assert step("ddp", buckets=4, overlap=True, backward_s=1.0) == pytest.approx(0.05 + comm / 4)
    # a PS's priority: the next forward (the compute less backward) hides it too
    assert step("ddp", buckets=4, overlap=True, backward_s=0.02, forward_hides=True) == pytest.approx(
        0.05 + comm - 0.02 * 3 / 4 - 0.03)


def test_ps_pipeline_fills_and_drains_with_its_largest_partition():
    """k = N = 8 servers, each 202,624 fp32 parameters in partitions of 65,536 (3 full, one of 6,016): push and
    pull as a two-stage flow shop over the partitions, simulated here, take R + the largest partition, not
    R (1 + 1/4) as four equal partitions would."""
    from psarch import registry
    from psarch.theory import cluster_step_time, predict
    cfg = from_dict({"backend": {"kind": "ps", "world_size": 8, "servers": 8, "partition_mb": 0.25},
                     "train": {"optimizer": "sgd", "global_batch": 8}})
    phi = 8 * 202_624
    parts = [65_536] * 3 + [202_624 - 3 * 65_536]
    push_done = pull_done = 0.0                  # each stage takes a partition's bytes x N / k at the link's rate
    for x in parts:
        push_done += x
        pull_done = max(pull_done, push_done) + x
    m = registry.spec_of(cfg).comm_model(cfg, phi, {})
    rate = 100e6 / 8 * 1448 / 1514 / 4          # fp32 elements per second on a 100 Mbit/s link
    got = cluster_step_time(predict(cfg, phi), 0.0, 100.0, 100.0, 0.0, m.buckets, False, 0, m.pipeline)["comm_s"]
    assert pull_done == 202_624 + 65_536
    assert got == pytest.approx(8 * pull_done / rate)     # a server takes N = 8 workers' partitions


def test_ps_overlap_hides_behind_its_last_servers_share_of_backward():
    """S = 1 MB, N = k = 4 dedicated servers, each range in 4 partitions pushed from backward's hooks: a server's
    range is a contiguous quarter of the parameters, ready within a quarter of backward, so the last server's link
    starts only then (all four workers' pushes of it on that one link). Link-bound: backward hides 1/4 x 3/4 of it,
    not (B - 1)/B = 15/16; compute-bound: after backward wait the last partition's push and pull, 2/5 of the
    exchange, not 1/16. Counted by hand."""
    from psarch.theory import cluster_step_time, config_for, predict
    p = predict(config_for("ps", 4, "fp32", "sgd", servers=4, partition_mb=0.0), 250_000)
    rate = 12.5e6 * 1448 / 1514
    comm = (1 + 1 / 4) * 1e6 / rate           # pipelined over 4 slots: (push + pull) / 4 + 3/4 of both at once

    def exposed(backward_s: float) -> float:
        return cluster_step_time(p, 0.2, 100.0, 100.0, 0.0, buckets=16, overlap=True, pipeline=4,
                                 backward_s=backward_s, ready_share=1 / 4)["comm_s"]
    assert exposed(0.08) == pytest.approx(comm - 0.08 / 4 * 3 / 4)
    assert exposed(1.0) == pytest.approx(comm * 2 / 5)
    cfg = from_dict({"backend": {"kind": "ps", "world_size": 4, "servers": 4}})
    from psarch import registry
    assert registry.spec_of(cfg).comm_model(cfg, 1_000_000, {}).ready_share == 0.25


def test_zero_all_gather_waits_for_the_optimizer_step():
    """ZeRO-1, S = 1 MB, N = 4, 100 Mbit/s, 4 buckets reduce-scattered from backward's hooks: the reduce-scatter
    (3/4 S, 3 hops) hides behind backward as DDP's buckets do, the all-gather of the updated parameters (3/4 S,
    3 hops) starts after the optimizer step and is exposed whole. Counted by hand."""
    from psarch.theory import cluster_step_time, config_for, predict
    p = predict(config_for("zero", 4, "fp32", "sgd", stage=1), 250_000)
    rate = 12.5e6 * 1448 / 1514
    one_pass = 0.75e6 / rate + 3e-4

    def exposed(backward_s: float) -> float:
        return cluster_step_time(p, 0.2, 100.0, 100.0, 1e-4, buckets=4, overlap=True, backward_s=backward_s,
                                 after_passes=1)["comm_s"]
    assert exposed(0.02) == pytest.approx(one_pass - 0.02 * 3 / 4 + one_pass)
    assert exposed(1.0) == pytest.approx(one_pass / 4 + one_pass)
    assert cluster_step_time(p, 0.2, 100.0, 100.0, 1e-4, after_passes=1)["comm_s"] == pytest.approx(2 * one_pass)


def test_cluster_model_per_backend():
    """Which backends overlap, their bucket counts, hidden passes and idle fraction by design
    (BackendSpec.comm_model): 1 MB of fp32 parameters; a pipeline waits its bubble, torch's pipelining none
    apart (its measured compute holds its waits)."""
    from dataclasses import asdict

    from psarch import registry

    def model(backend: dict, groups: int | None = None) -> dict:
        cfg = from_dict({"backend": {"world_size": 2, **backend}})
        extra = {"zero_groups": [groups, groups]} if groups is not None else {}
        return asdict(registry.spec_of(cfg).comm_model(cfg, 250_000, extra))

    one = {"hidden_passes": 0, "pipeline": 1, "forward_hides": False, "idle_fraction": 0.0, "ready_share": 1.0,
           "after_passes": 0}
    assert model({"kind": "ddp", "bucket_cap_mb": 0.25}) == {"buckets": 4, "overlap": True, **one}
    assert model({"kind": "ddp", "overlap_comm": False})["overlap"] is False
    assert model({"kind": "torch_ddp", "bucket_cap_mb": 0.5}) == {"buckets": 2, "overlap": True, **one}
    # stages 1-2 all-gather the updated parameters after the optimizer step, as ZeroRedundancyOptimizer broadcasts
    assert model({"kind": "zero", "reduce_bucket_size": 125_000}) == {"buckets": 2, "overlap": True, **one,
                                                                       "after_passes": 1}
    assert model({"kind": "torch_zero", "bucket_cap_mb": 0.5})["after_passes"] == 1
    # stage 3 reduce-scatters one unit at a time: its groups, never reduce_bucket_size (stages 1-2 only)
    assert model({"kind": "zero", "stage": 3}, groups=5) == {"buckets": 5, "overlap": True, **one,
                                                             "hidden_passes": 2}
    assert model({"kind": "zero", "stage": 3})["buckets"] == 1
    # ps: 125,000 parameters a server in partitions of 65,536: 2 each, pushed from backward's hooks (not in GEO)
    ps = {"kind": "ps", "servers": 2, "partition_mb": 0.25}
    assert model(ps) == {"buckets": 4, "overlap": True, **one, "pipeline": pytest.approx(125_000 / 65_536),
                         "ready_share": 0.5}
    # priority: the pulls also hide behind the next forward
    assert model(dict(ps, priority_credit_mb=0.5))["forward_hides"] is True
    assert model(dict(ps, mode="geo"))["overlap"] is False and model(dict(ps, partition_mb=0.0))["pipeline"] == 1
    assert model({"kind": "pipeline", "stages": 2, "microbatches": 2})["idle_fraction"] == pytest.approx(1 / 3)
    assert model({"kind": "torch_pipeline", "stages": 2, "microbatches": 2})["idle_fraction"] == 0.0


def test_results_label_tells_sparse_variants_apart():
    """A sparse sweep's rows: ddp dense, rows and sharded, and the PS modes, each under its own label."""
    from psarch import registry

    def arch(backend: dict) -> str:
        cfg = from_dict({"workload": {"model": "dlrm", "data": "clicks"}, "train": {"optimizer": "sgd"},
                         "backend": {"world_size": 4, **backend}})
        return registry.spec_of(cfg).label(cfg)

    assert arch({"kind": "ddp"}) == "ddp ring"
    assert arch({"kind": "ddp", "embeddings": "sharded"}) == "ddp ring, embeddings sharded"
    assert arch({"kind": "torch_ddp", "embeddings": "rows"}) == "torch_ddp, embeddings rows"
    assert arch({"kind": "ps", "servers": 2, "embeddings": "rows"}) == "ps sync, 2 servers, embeddings rows"
    assert arch({"kind": "ps", "servers": 4, "embeddings": "rows", "mode": "geo"}) == \
        "ps geo, N servers, embeddings rows"
    assert arch({"kind": "zero", "stage": 2}) == "zero-2 ring"


def test_server_link_defaults_to_link():
    c = from_dict({"backend": {"kind": "ps"}, "cluster": {"link_mbps": 100.0}}).cluster
    assert c.server_mbps == 100.0
    assert from_dict({"backend": {"kind": "ps"}, "cluster": {"link_mbps": 100.0, "server_link_mbps": 400.0}}
                     ).cluster.server_mbps == 400.0


def test_machine_checked_once_per_run(tmp_path, monkeypatch):
    """With cluster.emulate, check_machine creates and deletes a probe namespace: once per run (a single
    run and each sweep point), never again in `psarch run` or the launcher."""
    import psarch.cluster.preflight as preflight
    import psarch.launch as launch
    from psarch.cli import main

    probes = []
    monkeypatch.setattr(preflight, "missing", lambda: probes.append(1))   # None: the machine can emulate

    class Stop(RuntimeError):
        pass

    def stop(cfg):
        raise Stop("stopped after the checks")
    monkeypatch.setattr(launch, "place", stop)
    one = ["--set", "cluster.emulate=true", "--set", "workload.model=mlp", "--quiet"]
    (tmp_path / "one.toml").write_text('name = "one"\n')
    assert main(["run", str(tmp_path / "one.toml"), *one, "--out", str(tmp_path / "one")]) == 1   # Stop: failed
    assert len(probes) == 1
    probes.clear()
    (tmp_path / "sweep.toml").write_text('name = "s"\n[sweep]\n"train.lr" = [0.1, 0.2]\n')
    assert main(["run", str(tmp_path / "sweep.toml"), *one, "--out", str(tmp_path / "sweep")]) == 1
    assert len(probes) == 2                                                                     # one per point


def test_step_window_reads_while_every_rank_waits_at_a_mark():
    """The launcher reads the counters once every rank has reached a mark, before any goes on; a lost
    worker's abort releases the others, and the window then says it has none."""
    import multiprocessing

    from psarch.cluster.window import StepWindow

    phase = {"a": 0, "b": 0}           # how many marks each rank has passed
    reads = []

    def read():
        reads.append(dict(phase))
        return {"n": (len(reads), 0)}

    def rank(name: str, r: int, work: float) -> None:
        time.sleep(work)               # set-up of uneven length: the read must still wait for both
        w.marks[r].reached()
        phase[name] += 1
        time.sleep(work)
        w.marks[r].reached()
        phase[name] += 1

    w = StepWindow(multiprocessing.get_context("spawn"), 2, read)
    ranks = [threading.Thread(target=rank, args=(n, r, t)) for r, (n, t) in enumerate((("a", 0.0), ("b", 0.1)))]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(10)
    w.close()
    assert reads == [{"a": 0, "b": 0}, {"a": 1, "b": 1}] and phase == {"a": 2, "b": 2}
    assert w.steps() == ({"n": (1, 0)}, {"n": (2, 0)})

    lost = StepWindow(multiprocessing.get_context("spawn"), 2, read)
    alone = threading.Thread(target=lost.marks[0].reached)   # its peer died: it would wait forever
    alone.start()
    lost.abort()
    alone.join(10)
    assert not alone.is_alive() and lost.steps() is None
    lost.close()


KILLED_WITH_A_WINDOW = """
import multiprocessing as mp, multiprocessing.resource_tracker as rt, os, signal
from psarch.cluster.window import StepWindow
rt.ensure_running()   # as place() starts it for an emulated run
window = StepWindow(mp.get_context("spawn"), 2, dict)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_launcher_killed_with_its_step_window_leaks_nothing():
    """The window's marks are pipes, not a Barrier's named semaphores: multiprocessing's resource tracker,
    which outlives a launcher killed with SIGKILL, has nothing to clean up and warn of."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", KILLED_WITH_A_WINDOW], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert "leaked" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr



def test_crossover_table_divides_each_ps_run_by_its_ring_peer():
    """psarch.ps.crossover: PS / ring DDP at the same N and rate, measured and predicted, beside BytePS's bound
    N^2 / (N^2 + kN - 2k) (k = N dedicated: N / (2(N - 1)); colocated servers add no machine: 1)."""
    from psarch.ps.crossover import bound, table

    assert bound(4, 4, False) == pytest.approx(2 / 3) and bound(8, 8, False) == pytest.approx(4 / 7)
    assert bound(4, 1, False) == pytest.approx(16 / 18) and bound(4, 4, True) == pytest.approx(1.0)

    def run(backend: dict, measured: float, predicted: float) -> dict:
        cfg = from_dict({"backend": {"world_size": 4, **backend}, "cluster": {"link_mbps": 100.0}})
        return {"cfg": cfg, "label": backend["kind"], "measured_s": measured, "predicted_s": predicted}
    rows = table([run({"kind": "ps", "servers": 4}, 0.6, 0.5), run({"kind": "ddp", "comm": "ring"}, 1.0, 0.8),
                  run({"kind": "zero"}, 0.9, 0.9)]).splitlines()
    assert len(rows) == 4 and rows[2].startswith("| 100 | 4 | ddp |")   # zero left out, the ring first
    assert "| 0.60 \\| 0.62 | 0.67 |" in rows[3]


def test_ps_labels_tell_partitions_placement_overlap_and_priority_apart():
    from psarch import registry

    def arch(**backend) -> str:
        cfg = from_dict({"backend": {"kind": "ps", "world_size": 4, "servers": 4, **backend}})
        return registry.spec_of(cfg).label(cfg)
    assert arch() == "ps sync, N servers"   # the default partitions go unsaid
    assert arch(partition_mb=0.0) == "ps sync, N servers, whole ranges"
    assert arch(server_placement="colocated") == "ps sync, N servers, colocated"
    assert arch(overlap_comm=False) == "ps sync, N servers, pushed after backward"
    assert arch(priority_credit_mb=0.5) == "ps sync, N servers, priority 0.5 MiB"
