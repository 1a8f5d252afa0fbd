"""An emulated cluster on one Linux machine: a network namespace per node, a veth from each node to one
bridge, and a rate-limiting qdisc on both ends of each veth so each direction runs at the link rate (`shaper`:
htb at the link rate, TCP's acknowledgements served first beside it, the rest in queues of QUEUE_S at the cluster's
link rate, one per peer: per destination out of a node, per sender into it).

Layout of run <pid>: namespace `psarch-<pid>-hub` holds the bridge `br0` (10.213.0.1, where the launcher
hosts the rendezvous store) and the bridge end of every veth (`w<i>`, `s<i>`); node namespaces
`psarch-<pid>-w<i>` (workers, 10.213.1.<i+1>) and `psarch-<pid>-s<i>` (PS servers, 10.213.2.<i+1>) hold
`eth0`. Nothing is created in the machine's own namespace, and the 10.213/16 addresses exist only inside
the run's namespaces, so no packet can leave the machine. Latency is not emulated (no `netem` here).

Many flows both ways at once (a PS's pipelined pushes and pulls) get each link's full-duplex rate, and many
senders into one node (N workers into k < N servers) share its link fairly, only with four settings
(bulk TCP both ways lost a fifth or more of its ideal time on plain token buckets, close to none with these,
into k < N nodes too: the device crossover study's duplex_flows.py measures it):
- fair shares into a node: on the bridge's end of its link each other node's traffic waits in a FIFO of its
  own, served round robin. In one FIFO a flow that fell behind stayed behind (TCP's shares are unequal in a
  deep queue); a PS server, which answers a partition's pulls once every worker's push of it is in, then
  waited on the slowest worker for every partition. Out of a node, a FIFO per peer it sends to (a host's
  fair-queueing qdisc keeps one per flow): a small message to one peer does not wait behind a large one to another;
- acknowledgements first: on a plain token bucket (`tbf`) a node's acknowledgements wait behind its own
  bulk data, up to QUEUE_S, and the flows they clock stall (worst where N/k senders fill one server's queue).
  Only segments without data: a flow's packets keep their order (tests/test_cluster_order.py);
- GSO segments cut to what the link sends in SEGMENT_S (one MTU at 12 Mbit/s; a 64 KiB segment holds such a
  link 44 ms), a NIC's segment at the link's rate (`gso_segments`);
- TCP small queues (net.ipv4.tcp_limit_output_bytes, 4 MiB by default) of two such segments (`tsq_bytes`),
  as on a host whose NIC runs at the link rate: with 4 MiB each, a node's few sockets overfilled its own
  link's queue and lost packets there.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from psarch.cluster import netns

if TYPE_CHECKING:
    from psarch.cluster.records import NodeReport

PREFIX = "psarch-"
IFNAME = "eth0"                 # every node's interface: GLOO_SOCKET_IFNAME names it
HUB_ADDRESS = "10.213.0.1"
MAX_NODES = 250                 # host numbers 1..250 in each of the 10.213.1 and 10.213.2 subnets
QUEUE_S = 0.2                   # the bulk queue, as time at the cluster's link rate: long enough that TCP is not starved
QUEUE_MAX = 2**31                # bytes: bfifo's limit is a u32 (past 172 Gbit/s QUEUE_S would not fit); no window fills it
# u32 matches, one per TCP header length (data offset 5-15 words), of a TCP segment in IPv4 without options that
# carries no data (its IP total length is the two headers') and is neither FIN nor RST: TCP's acknowledgements, SYNs
ACKNOWLEDGEMENTS = [["match", "u8", "0x45", "0xff", "at", "0",
                      "match", "u16", f"0x{20 + 4 * words:04x}", "0xffff", "at", "2",
                      "match", "ip", "protocol", "6", "0xff",
                      "match", "u8", f"0x{words << 4:02x}", "0xf0", "at", "32",
                      "match", "u8", "0x00", "0x05", "at", "33"] for words in range(5, 16)]
SEGMENT_S = 0.001               # the longest one GSO segment holds a link
BUCKET_S = 0.002                # what a link's shaper may send at once after an idle spell (`shaper`)
WIRE = 1514                     # a 1500-byte IP packet on the wire (Ethernet header included)
TSQ_SYSCTL = "/proc/sys/net/ipv4/tcp_limit_output_bytes"


@dataclass(frozen=True)
class Node:
    """One emulated machine: a worker or a PS server, its namespace, address and link rate."""

    role: str            # "worker" or "server"
    index: int           # rank of a worker, index of a server
    ns: str
    port: str            # the bridge end of its veth, in the hub namespace
    address: str
    mbps: float

    def to_dict(self) -> NodeReport:
        if self.role == "worker":
            return {"node": self.ns, "role": self.role, "rank": self.index, "address": self.address,
                    "link_mbps": self.mbps}
        return {"node": self.ns, "role": self.role, "server": self.index, "address": self.address,
                "link_mbps": self.mbps}


def plan(pid: int, workers: int, servers: int, link_mbps: float, server_mbps: float) -> list[Node]:
    """The nodes of run `pid`: names, addresses and link rates (no system call)."""
    if workers > MAX_NODES or servers > MAX_NODES:
        raise ValueError(f"an emulated cluster has at most {MAX_NODES} workers and {MAX_NODES} servers; "
                         f"got {workers} and {servers}")
    return ([Node("worker", i, f"{PREFIX}{pid}-w{i}", f"w{i}", f"10.213.1.{i + 1}", link_mbps) for i in range(workers)]
            + [Node("server", i, f"{PREFIX}{pid}-s{i}", f"s{i}", f"10.213.2.{i + 1}", server_mbps)
               for i in range(servers)])


def shaper(dev: str, mbps: float, peers: Sequence[str] = (), dilation: float = 1.0,
           by: str = "src") -> list[list[str]]:
    """The `tc` commands (each after `tc -n <namespace>`) that limit `dev`'s egress to `mbps` Mbit/s: an htb
    class at the rate whose bucket holds 2 ms of traffic (the kernel timer's slack; at least two of the link's GSO
    segments, `tsq_bytes`). A real link has no bucket: what it holds goes at once after an idle spell, so it is
    kept that small (it was 64 KiB, a tbf's floor for a whole GSO segment, which let 52 ms of a 10 Mbit/s link's
    traffic through at once; htb sends a packet larger than its bucket and owes the difference).
    TCP's acknowledgements are served first (u32 filters: TCP segments that carry no data, neither FIN nor RST,
    ACKNOWLEDGEMENTS), from a class of their own at the rate, beside the link's class, not under it: their bytes are
    not counted in the link's rate (an acknowledgement is 66 B against 2 data frames, about 2% of the reverse way).
    Under the link's class each peer's traffic borrows above its fair share, and waited there until the link's class
    had paid for the acknowledgements it had also been charged: about a frame a message in a ring of messages of a
    few frames (tests/test_cluster_ring.py). Data is never served first, however short: a flow's short segment (a
    message's last bytes, a small message behind a large one) overtook its own flow's queued data, and TCP took the
    reordering for loss and sent data again (experiments/compression/README.md, "Three defects of the emulation").
    The rest wait in FIFOs of QUEUE_S at the rate, in bytes: one per address in `peers` (the packets' source address
    where `by` is "src", their destination's where it is "dst"), shared fairly (htb's round robin; each may use the
    whole rate alone), and one for everything else.
    `dilation`: D of a link shaped to the cluster's rate / D. Time dilation slows rates and times, never bytes (a
    message, a TCP window, what a switch's queue holds): the FIFOs hold QUEUE_S at the cluster's rate, mbps x D. At
    the shaped rate they held D times fewer bytes, and the windows N workers' pushes opened into one server were
    dropped there, as the cluster's queues would not drop them (the bucket and the segments stay at the shaped
    rate: they are the kernel's timer and the link's time, wall clock)."""
    if by not in ("src", "dst"):
        raise ValueError(f"shaper: by must be 'src' or 'dst', not {by!r}")
    rate = f"{mbps * 1000:.0f}kbit"
    burst = str(max(tsq_bytes(mbps), int(mbps * 1e6 / 8 * BUCKET_S)))
    bucket = ["rate", rate, "ceil", rate, "burst", burst, "cburst", burst]
    queue = str(min(QUEUE_MAX, max(10 * WIRE, int(mbps * dilation * 1e6 / 8 * QUEUE_S))))
    out = [["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
           ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", *bucket],
           ["class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", *bucket, "prio", "0"],
           ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", *bucket, "prio", "1"],
           ["qdisc", "add", "dev", dev, "parent", "1:20", "bfifo", "limit", queue],
           *(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", *ack, "flowid", "1:10"]
             for ack in ACKNOWLEDGEMENTS)]
    share = f"{mbps * 1000 / max(1, len(peers)):.0f}kbit"
    for j, address in enumerate(peers):
        leaf = f"1:{0x100 + j:x}"
        out += [["class", "add", "dev", dev, "parent", "1:1", "classid", leaf, "htb", "rate", share, "ceil", rate,
                 "burst", burst, "cburst", burst, "prio", "1"],
                ["qdisc", "add", "dev", dev, "parent", leaf, "bfifo", "limit", queue],
                ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "2", "u32",
                 "match", "ip", by, f"{address}/32", "flowid", leaf]]
    return out


def tc_batch(ns: str, commands: list[list[str]]) -> None:
    """Run `tc` commands in namespace `ns` in one process (`tc -batch`): a cluster of 16 nodes has ~2,000."""
    p = subprocess.run(["tc", "-n", ns, "-batch", "-"], input="\n".join(" ".join(c) for c in commands) + "\n",
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise netns.NetnsError(f"`tc -n {ns} -batch` failed: {p.stderr.strip() or p.returncode}")


def gso_segments(mbps: float) -> int:
    """Packets per GSO segment on a link of `mbps`: what it sends in SEGMENT_S, 1 to 64 (64 KiB)."""
    return max(1, min(64, int(mbps * 1e6 / 8 * SEGMENT_S / WIRE)))


def tsq_bytes(mbps: float) -> int:
    """net.ipv4.tcp_limit_output_bytes for a node on a link of `mbps`: two segments (the kernel's own floor)."""
    return 2 * gso_segments(mbps) * WIRE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces (and what runs in them) of psarch runs whose launcher is gone."""
    removed = []
    for ns in netns.names(PREFIX):
        pid = ns[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            netns.remove(ns)
            removed.append(ns)
    return removed


class EmulatedCluster:
    """Create the nodes of a run; `close()` removes them. A watcher process removes them if this
    process dies without closing (SIGKILL); a later run removes any a dead run left (remove_stale)."""

    def __init__(self, workers: int, servers: int, link_mbps: float, server_mbps: float, dilation: float = 1.0) -> None:
        """link_mbps, server_mbps: the rates the links are shaped to (the cluster's / `dilation`, D)."""
        self.pid = os.getpid()
        self.dilation = dilation
        self.prefix = f"{PREFIX}{self.pid}-"
        self.hub = f"{self.prefix}hub"
        self.nodes = plan(self.pid, workers, servers, link_mbps, server_mbps)
        self._watcher: subprocess.Popen | None = None
        remove_stale()
        try:
            self._watch()
            self._create()
        except BaseException:
            self.close()
            raise

    def _watch(self) -> None:
        # Its own session: a Ctrl-C to the launcher's process group must not stop the clean-up too.
        self._watcher = subprocess.Popen([sys.executable, str(Path(__file__).with_name("watch.py")), self.prefix],
                                         stdin=subprocess.PIPE, start_new_session=True)

    def _create(self) -> None:
        hub = self.hub
        netns.run("ip", "netns", "add", hub)
        netns.run("ip", "-n", hub, "link", "set", "lo", "up")
        netns.run("ip", "-n", hub, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        netns.run("ip", "-n", hub, "addr", "add", f"{HUB_ADDRESS}/16", "dev", "br0")
        netns.run("ip", "-n", hub, "link", "set", "br0", "up")
        for n in self.nodes:
            netns.run("ip", "netns", "add", n.ns)
            netns.run("ip", "link", "add", "name", n.port, "netns", hub, "type", "veth",
                      "peer", "name", IFNAME, "netns", n.ns)
            netns.run("ip", "-n", hub, "link", "set", n.port, "master", "br0", "up")
            netns.run("ip", "-n", n.ns, "addr", "add", f"{n.address}/16", "dev", IFNAME)
            netns.run("ip", "-n", n.ns, "link", "set", IFNAME, "up")
            netns.run("ip", "-n", n.ns, "link", "set", "lo", "up")
            others = [m.address for m in self.nodes if m.address != n.address]
            # node -> bridge: its traffic to each other node in a queue of its own, fairly shared (a host's
            # fair-queueing qdisc keeps one per flow); bridge -> node: each other node's into this link, the same
            tc_batch(n.ns, shaper(IFNAME, n.mbps, others, self.dilation, by="dst"))
            tc_batch(hub, shaper(n.port, n.mbps, others, self.dilation))
            segments = str(gso_segments(n.mbps))
            netns.run("ip", "-n", n.ns, "link", "set", IFNAME, "gso_max_segs", segments)
            netns.run("ip", "-n", hub, "link", "set", n.port, "gso_max_segs", segments)
            with netns.inside(n.ns):     # /proc/sys/net is the opening thread's namespace's
                Path(TSQ_SYSCTL).write_text(str(tsq_bytes(n.mbps)))

    def node(self, role: str, index: int) -> Node:
        for n in self.nodes:
            if n.role == role and n.index == index:
                return n
        raise KeyError(f"no {role} {index} in this cluster")

    def counters(self) -> dict[str, tuple[int, int]]:
        """{node namespace: (bytes the node sent, bytes it received)} on its link so far. Read at the
        bridge end: what the node sends, the bridge end receives, and the other way round."""
        ports = netns.link_bytes(self.hub)
        return {n.ns: (ports[n.port][1], ports[n.port][0]) for n in self.nodes}

    def wire(self) -> dict[str, tuple[int, int, int]]:
        """{node namespace: (packets the node sent, packets it received, TCP segments it retransmitted)} so far:
        what its link's bytes hold beside the messages (each packet's headers, data or acknowledgement, and the
        payload TCP sent again), read as `counters` reads the bytes."""
        ports = netns.link_stats(self.hub)
        return {n.ns: (ports[n.port][1][1], ports[n.port][0][1], netns.tcp_retransmitted(n.ns)) for n in self.nodes}

    def close(self) -> None:
        """Remove every namespace of this run (killing what still runs there), then end the watcher."""
        for ns in [n.ns for n in self.nodes] + [self.hub]:
            netns.remove(ns)
        if self._watcher is not None:
            assert self._watcher.stdin is not None   # started with stdin=PIPE
            self._watcher.stdin.close()     # EOF: the watcher finds nothing left and exits
            self._watcher.wait(timeout=30)
            self._watcher = None
