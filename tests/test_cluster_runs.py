"""Runs on an emulated cluster: emulation changes timing, never results; link counters agree with the
meters; nothing is left behind after a normal exit, a crashed rank, Ctrl-C or a killed launcher."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_setup import leftovers, needs_root, watchers
from parity import assert_same_model, config, model
from psarch.config import from_dict
from psarch.launch.ranks import RunError, run
from timing import scaled

pytestmark = needs_root
LINK = {"emulate": True, "link_mbps": 200.0}
BACKENDS = {   # name: backend section; each runs on 2 emulated workers (the PS also on 2 server nodes)
    "ddp_ring": {"kind": "ddp", "world_size": 2, "comm": "ring"},
    "zero3": {"kind": "zero", "world_size": 2, "stage": 3},
    "ps_sync": {"kind": "ps", "world_size": 2, "mode": "sync", "servers": 2},
    "single": {"kind": "single", "world_size": 1},
}
# Headers (Ethernet + IP + TCP, ~66 B per <=1448 B of payload: < 5%), plus the rendezvous, gloo's
# connection set-up and the closing barrier, which no meter counts.
HEADERS, SETUP_BYTES = 1.08, 48 * 1024
# Over the steps, a link's bytes are its payload plus each packet's headers, counted (the cluster's report): every
# packet, data or acknowledgement, 66 B (Ethernet 14, IPv4 20, TCP 32 with timestamps; a GSO segment of several
# packets counts once, in bytes and in packets, with one set of headers: a quiet machine sends fewer, larger ones,
# at 200 Mbit/s the ring's 3.8% of headers where a loaded one's 8.2%); the payload is what the
# meters counted, what TCP sent again (at most a full segment, MSS, for each segment its node retransmitted: tail
# loss probes fire where an acknowledgement comes late, more often on a loaded machine) and a little of no meter's.
HEADER_BYTES, MSS = 66, 1448
STEPS_SLACK = 4 * 1024   # of no meter's: ZMTP's framing, SACK options, a log step's loss mean
ARP_SLACK = 4 * HEADER_BYTES   # below: a few packets shorter than a TCP header (ARP's 42 B)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("cluster_runs")
    summaries = {"reference": run(from_dict(config("reference", backend=BACKENDS["single"])), out / "reference",
                                  echo=False)}
    with _stderr_into(out / "stderr.txt"):   # what the launcher and its ranks wrote there (C++ included)
        for name, backend in BACKENDS.items():
            summaries[name] = run(from_dict(config(name, backend=backend, cluster=LINK)), out / name, echo=False)
    return out, summaries


@contextlib.contextmanager
def _stderr_into(path: Path):
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_emulated_run_ends_with_the_same_model(runs, name):
    out, summaries = runs
    assert_same_model(model(out / name, "model"), model(out / "reference", "model"), name)
    nodes = summaries[name]["cluster"]["nodes"]
    assert [n["role"] for n in nodes] == ["worker"] * BACKENDS[name]["world_size"] + ["server"] * (2 if name == "ps_sync" else 0)
    assert not leftovers(os.getpid()) and not watchers(os.getpid())


def _steps_meters(s: dict) -> list[tuple[float, float]]:
    """Each worker's metered (sent, received) over its steps (set-up and export left out)."""
    return [(t["sent_per_step"] * s["steps"], t["received_per_step"] * s["steps"]) for t in s["traffic"]["per_rank"]]


@pytest.mark.parametrize("name", ["ddp_ring", "ps_sync"])
def test_link_counters_over_the_steps_agree_with_the_meters(runs, name):
    """Read right before the first step and after the last: each worker's link carried what its meter
    counted in its steps, plus each of its packets' headers and what TCP sent again, both counted (the PS
    servers: what the workers sent them and got back)."""
    s = runs[1][name]
    assert s["cluster"]["counted_over"] == "steps"
    nodes = s["cluster"]["nodes"]
    workers, servers = [n for n in nodes if n["role"] == "worker"], [n for n in nodes if n["role"] == "server"]
    metered = _steps_meters(s)
    resent = sum(n["retransmitted_segments"] for n in nodes)
    # (link bytes, its packets, what the meters counted, segments its senders retransmitted)
    pairs = [(n["link_sent"], n["link_packets_sent"], sent, n["retransmitted_segments"])
             for n, (sent, _) in zip(workers, metered)]
    pairs += [(n["link_received"], n["link_packets_received"], received, resent - n["retransmitted_segments"])
              for n, (_, received) in zip(workers, metered)]
    if servers:   # workers talk only to servers: together, the servers took in what the workers sent
        pairs += [(sum(n["link_received"] for n in servers), sum(n["link_packets_received"] for n in servers),
                   sum(m[0] for m in metered), sum(n["retransmitted_segments"] for n in workers)),
                  (sum(n["link_sent"] for n in servers), sum(n["link_packets_sent"] for n in servers),
                   sum(m[1] for m in metered), sum(n["retransmitted_segments"] for n in servers))]
    for link, packets, meter, retransmitted in pairs:
        headers = HEADER_BYTES * packets
        assert meter + headers - ARP_SLACK <= link <= meter + headers + MSS * retransmitted + STEPS_SLACK, \
            (name, link, meter, packets, retransmitted)


@pytest.mark.parametrize("name", ["ddp_ring", "ps_sync"])
def test_link_counters_over_the_run_agree_with_the_meters(runs, name):
    """The whole run's counters (run_link_*): what the meters counted in all, plus headers and set-up."""
    s = runs[1][name]
    nodes = s["cluster"]["nodes"]
    metered = [(t["sent"], t["received"]) for t in s["traffic"]["per_rank"]]
    if name == "ps_sync":   # the servers' meters count every frame on their sockets
        metered += [(t["sent"], t["received"]) for t in s["traffic"]["servers"]]
    assert len(metered) == len(nodes)
    for n, (sent, received) in zip(nodes, metered):
        for link, meter in ((n["run_link_sent"], sent), (n["run_link_received"], received)):
            assert meter <= link <= meter * HEADERS + SETUP_BYTES, (n["node"], link, meter)
        assert n["link_sent"] < n["run_link_sent"] and n["link_received"] < n["run_link_received"]


def test_colocated_servers_share_their_workers_nodes_and_links(runs, tmp_path):
    """backend.server_placement = "colocated": no node of the servers' own; server i binds worker i's address;
    a worker's pushes to its own server and that server's replies to it never reach the link, so each link
    carries about half of what its worker and server meters count (N = 2), and the model is the reference's."""
    backend = dict(BACKENDS["ps_sync"], server_placement="colocated", partition_mb=0.001)
    s = run(from_dict(config("colocated", backend=backend, cluster=LINK)), tmp_path / "colocated", echo=False)
    assert_same_model(model(tmp_path / "colocated", "model"), model(runs[0] / "reference", "model"), "colocated")
    nodes = s["cluster"]["nodes"]
    assert [n["role"] for n in nodes] == ["worker", "worker"]
    assert [d["address"].split("//")[1].rsplit(":", 1)[0] for d in s["servers_detail"]] == \
        [n["address"] for n in nodes]
    workers, servers = s["traffic"]["per_rank"], s["traffic"]["servers"]
    for n, w, v in zip(nodes, workers, servers):
        for link, metered in ((n["run_link_sent"], w["sent"] + v["sent"]),
                              (n["run_link_received"], w["received"] + v["received"])):
            assert 0.4 * metered < link < 0.6 * metered * HEADERS + SETUP_BYTES, (n["node"], link, metered)


def test_crashed_rank_leaves_nothing(tmp_path):
    # cpu-measured: the default device (this core, measured in the launcher) would call the loss there first
    cfg = from_dict(config("crash", backend=BACKENDS["ddp_ring"], cluster={**LINK, "device": "cpu-measured"},
                           workload={"factory": "factories:fails_at_step_2"}))
    with pytest.raises(RunError, match="deliberate failure at step 2"):
        run(cfg, tmp_path / "crash", echo=False)
    assert not leftovers(os.getpid()) and not watchers(os.getpid())


def test_emulated_runs_print_no_name_lookup_warnings(runs):
    """The emulated network has no name service: torch's c10d warned once per process (the launcher and every
    rank) that it could not reverse-resolve an address. Neither now writes it."""
    stderr = (runs[0] / "stderr.txt").read_text()
    assert "c10d" not in stderr and "hostname" not in stderr, stderr


HOLD = """
import signal, sys, subprocess
# Ctrl-C as at a terminal: a suite started as a background job of a script inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
from psarch.cluster.placement import place
from psarch.config import from_dict
cfg = from_dict({"backend": {"kind": "ps", "world_size": 2}, "cluster": {"emulate": True, "device": "cpu-measured"}})
with place(cfg) as where:
    with where.node("worker", 1):   # a process on a node, as a rank would be
        p = subprocess.Popen(["sleep", "60"])
    print(p.pid, flush=True)
    p.wait()
"""


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_or_killed_launcher_leaves_nothing(how):
    """Ctrl-C unwinds the launcher, which removes its cluster; SIGKILL leaves the clean-up to the watcher."""
    launcher = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    assert leftovers(launcher.pid)                       # the cluster and its node process are up
    launcher.send_signal(how)
    launcher.wait(30)
    deadline = time.monotonic() + scaled(15)
    while (leftovers(launcher.pid) or watchers(launcher.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(launcher.pid) and not watchers(launcher.pid)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"


def test_results_table_has_every_emulated_run(runs):
    from psarch.report.cluster import rows, table
    out, summaries = runs
    found = rows(out)                                   # the loopback reference is left out
    assert sorted(r["measured"] for r in found) == sorted(summaries[n]["step_time_s"] for n in BACKENDS)
    single = next(r for r in found if r["arch"] == "single")
    assert single["predicted"] == pytest.approx(single["compute"])   # nothing on the wire
    assert len(table(found).splitlines()) == 2 + len(BACKENDS)
