"""The emulated cluster itself: preflight errors, the plan of nodes, real shaping and link counters, the step
window, and the results' labels and tables (its step-time theory: test_cluster_theory.py)."""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from cluster_setup import leftovers, needs_root
from psarch.cluster import netns
from psarch.cluster.emulated import BUCKET_S, IFNAME, EmulatedCluster, gso_segments, plan, tsq_bytes
from psarch.cluster.preflight import missing
from psarch.config import ConfigError, check_machine, from_dict
from timing import scaled


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


def _send(c: EmulatedCluster, size: int, idle_s: float = 0.0) -> tuple[int, float, dict, dict]:
    """`size` bytes from node 0 to node 1 over TCP, `idle_s` after connecting: (bytes received, seconds from the
    first byte sent to the last received, the link counters before connecting and after)."""
    ready, port, got = threading.Event(), [], []
    t = threading.Thread(target=_serve, args=(c.nodes[1].ns, ready, port, got), daemon=True)
    t.start()
    ready.wait(10)
    before = c.counters()
    with netns.inside(c.nodes[0].ns):
        s = socket.create_connection((c.nodes[1].address, port[0]), timeout=scaled(30))
    time.sleep(idle_s)
    t0 = time.perf_counter()
    s.sendall(os.urandom(size))
    s.close()
    t.join(30)
    n, t1 = got[0]
    return n, t1 - t0, before, c.counters()


@needs_root
def test_shaping_is_real_and_counted():
    """X bytes between two nodes at L Mbit/s take at least X*8/L seconds and not much more; the link
    counters see them, plus TCP/IP headers (about 5% at 1500-byte frames)."""
    mbps, size = 20.0, 2_500_000            # 1.0 s at the link rate
    c = EmulatedCluster(2, 0, mbps, mbps)
    try:
        wire0 = c.wire()
        n, took, before, after = _send(c, size)
        wire1 = c.wire()
        snmp = netns.run("ip", "netns", "exec", c.nodes[0].ns, "cat", "/proc/net/snmp").split("\n")
    finally:
        c.close()
    ideal = size * 8 / (mbps * 1e6)
    assert n == size
    assert ideal * 0.97 <= took <= ideal * 1.3 + 0.2, (took, ideal)
    sent = after[c.nodes[0].ns][0] - before[c.nodes[0].ns][0]
    received = after[c.nodes[1].ns][1] - before[c.nodes[1].ns][1]
    assert size < sent < size * 1.08 and size < received < size * 1.08, (sent, received)
    # wire(): every packet is its payload plus 66 B of headers (Ethernet, IPv4, TCP with timestamps; within one
    # packet's headers over 1,700: the SYN's options, ARP), what TCP sent again adds to the payload; the node's own
    # TCP counters, not the machine's
    (p0, q0, r0), (p1, q1, r1) = wire0[c.nodes[0].ns], wire1[c.nodes[0].ns]
    tcp = [line.split() for line in snmp if line.startswith("Tcp:")]
    assert r1 == int(dict(zip(tcp[0], tcp[1]))["RetransSegs"])
    assert -66 <= sent - size - 66 * (p1 - p0) <= 66 + 1448 * (r1 - r0) and q1 - q0 > 0, (sent, size, p1 - p0, r1 - r0)
    assert not leftovers(os.getpid())


@needs_root
def test_a_message_after_an_idle_spell_waits_its_bytes_at_the_link_rate():
    """A real link has no bucket to spend after an idle spell: 60 kB sent on an idle 10 Mbit/s link take their 48 ms
    less at most the shaper's bucket (2 ms, or two GSO segments; a 64 KiB bucket let them through in under 1 ms).
    Load can only slow a shaped link, so the bound holds on a busy machine."""
    mbps, size = 10.0, 60_000
    c = EmulatedCluster(2, 0, mbps, mbps)
    try:
        n, took, _, _ = _send(c, size, idle_s=0.5)   # the handshake's few bytes long gone: the bucket is full
    finally:
        c.close()
    bucket = max(tsq_bytes(mbps), mbps * 1e6 / 8 * BUCKET_S)
    assert n == size
    assert took >= (size - bucket) * 8 / (mbps * 1e6), (took, bucket)
    assert not leftovers(os.getpid())


def test_segments_and_small_queues_are_sized_to_the_link():
    """A GSO segment holds the link about 1 ms (one packet at 12 Mbit/s, 64 KiB at 1 Gbit/s and above), and a
    socket keeps two of them in its link's queue (the kernel's 4 MiB overfills a 12 Mbit/s link's queue)."""
    assert [gso_segments(m) for m in (12, 100, 125, 1000, 10_000)] == [1, 8, 10, 64, 64]
    assert tsq_bytes(12) == 2 * 1514 and tsq_bytes(1000) == 2 * 64 * 1514


@needs_root
def test_each_node_is_set_to_its_link():
    """Both ends of a node's veth are shaped at its rate, segments without data first, and cut segments as gso_segments
    says; on each end every other node's traffic has a leaf of its own (by destination on the node's end, by source
    on the bridge's); the node's TCP small queues hold tsq_bytes: read back from the kernel, two workers on 12
    Mbit/s beside a server on 1 Gbit/s. After a bulk transfer, the data went by its destination's leaf and its
    sender's, and the acknowledgements by the acknowledgements' class."""
    c = EmulatedCluster(2, 1, 12.0, 1000.0)
    try:
        for n in c.nodes:
            node_end = netns.run("ip", "-d", "-n", n.ns, "link", "show", IFNAME)
            bridge_end = netns.run("ip", "-d", "-n", c.hub, "link", "show", n.port)
            for shown in (node_end, bridge_end):
                assert f"gso_max_segs {gso_segments(n.mbps)} " in shown, shown
            rate = "12Mbit" if n.mbps == 12.0 else "1Gbit"
            for ns, dev, offset in ((n.ns, IFNAME, 16), (c.hub, n.port, 12)):
                classes = netns.run("tc", "-n", ns, "class", "show", "dev", dev)
                assert classes.count(f"rate {rate} ceil {rate}") == 3, classes
                assert classes.count(f"ceil {rate}") == 3 + 2, classes
                filters = netns.run("tc", "-n", ns, "filter", "show", "dev", dev)
                # TCP in IPv4 without options, its length (bytes 2-3) the headers' (TCP's: byte 32's data offset)
                assert "flowid 1:10" in filters and "match 00060000/00ff0000 at 8" in filters, filters
                for words in range(5, 16):   # ... and neither FIN nor RST (byte 33)
                    assert f"match 4500{20 + 4 * words:04x}/ff00ffff at 0" in filters, (words, filters)
                    assert f"match {words << 4:02x}000000/f0050000 at 32" in filters, (words, filters)
                assert "class htb 1:10 root prio 0" in classes, classes    # beside the link's class, not under it
                assert "flowid 1:101" in filters, filters
                for other in c.nodes:    # a destination (IP offset 16) or source (12) address match per other node
                    want = "".join(f"{int(b):02x}" for b in other.address.split("."))
                    assert (f"match {want}/ffffffff at {offset}" in filters) == (other is not n), (other, filters)
            tsq = netns.run("ip", "netns", "exec", n.ns, "cat", "/proc/sys/net/ipv4/tcp_limit_output_bytes")
            assert int(tsq) == tsq_bytes(n.mbps), (n, tsq)
        worker, _, server = c.nodes
        ready, port, got = threading.Event(), [], []
        t = threading.Thread(target=_serve, args=(server.ns, ready, port, got), daemon=True)
        t.start()
        ready.wait(10)
        with netns.inside(worker.ns):
            s = socket.create_connection((server.address, port[0]), timeout=scaled(30))
        s.sendall(bytes(300_000))
        s.close()
        t.join(30)
        assert got[0][0] == 300_000
        sent = {n.ns: _class_bytes(n.ns, IFNAME) for n in c.nodes}
        assert sent[worker.ns]["1:101"] > 300_000 and sent[server.ns]["1:10"] > 0, sent   # data (to the server); acks
        assert sent[server.ns]["1:100"] < 10_000, sent        # nothing long went back
        into_server = _class_bytes(c.hub, server.port)      # worker 0 is the first of the server's senders
        assert into_server["1:100"] > 300_000 and into_server["1:101"] == 0, into_server
    finally:
        c.close()
    assert int(Path("/proc/sys/net/ipv4/tcp_limit_output_bytes").read_text()) > tsq_bytes(12), \
        "the machine's own namespace is left as it was"
    assert not leftovers(os.getpid())


def _class_bytes(ns: str, dev: str) -> dict[str, int]:
    """{htb class: bytes it sent} on `dev` in namespace `ns` (`tc -s class show`)."""
    out, cls = {}, None
    for line in netns.run("tc", "-s", "-n", ns, "class", "show", "dev", dev).splitlines():
        if line.startswith("class htb"):
            cls = line.split()[2]
        elif line.strip().startswith("Sent") and cls:
            out[cls] = int(line.split()[1])
    return out


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
    """With cluster.emulate, check_machine creates and deletes a probe namespace: once per run, once for all of
    a sweep's points, never again in `psarch run` or the launcher."""
    import psarch.cluster.preflight as preflight
    import psarch.launch.ranks as launch
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
    assert len(probes) == 1                                                      # once for both points


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

    proc = subprocess.run([sys.executable, "-c", KILLED_WITH_A_WINDOW], capture_output=True, text=True,
                          timeout=scaled(60))
    assert proc.returncode == -9, proc.stderr
    assert "leaked" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr



def test_crossover_table_divides_each_ps_run_by_its_ring_peer():
    """psarch.report.crossover: PS / ring DDP at the same N and rate, measured and predicted, beside BytePS's bound
    N^2 / (N^2 + kN - 2k) (k = N dedicated: N / (2(N - 1)); colocated servers add no machine: 1)."""
    from psarch.report.crossover import bound, table

    assert bound(4, 4, False) == pytest.approx(2 / 3) and bound(8, 8, False) == pytest.approx(4 / 7)
    assert bound(4, 1, False) == pytest.approx(16 / 18) and bound(4, 4, True) == pytest.approx(1.0)

    def run(backend: dict, measured: float, predicted: float, workload: dict | None = None) -> dict:
        cfg = from_dict({"backend": {"world_size": 4, **backend}, "cluster": {"link_mbps": 100.0},
                         "workload": workload or {}})
        return {"cfg": cfg, "label": backend["kind"], "measured_s": measured, "predicted_s": predicted}
    hybrid = run({"kind": "ddp", "embeddings": "ps", "servers": 2}, 0.7, 0.7, {"model": "dlrm", "data": "clicks"})
    rows = table([run({"kind": "ps", "servers": 4}, 0.6, 0.5), run({"kind": "ddp", "comm": "ring"}, 1.0, 0.8),
                  run({"kind": "zero"}, 0.9, 0.9), hybrid]).splitlines()
    assert len(rows) == 4 and rows[2].startswith("| 100 | 4 | ddp |")   # zero and the hybrid left out, the ring first
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
