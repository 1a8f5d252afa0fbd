"""Where an emulated run's link bytes go: TCP's own counters beside the links' (issue 34: the uncompressed PS's links
carried 660 KiB a worker-step at N = 8, 100 Mbit/s, against 432 KiB the PS counted).

Runs one config (one run, not a sweep) with every read of the cluster's link counters (the run's start, the steps'
two marks, its end) taking beside them, in every namespace of the run: the TCP counters (/proc/net/snmp and
/proc/net/netstat, what `nstat -az` shows), each socket's tcp_info (`ss -tin`: bytes sent, retransmitted, acked),
each link's packets (`ip -s link`) and every qdisc's drops (`tc -s qdisc`). Over the steps' window it prints, per
worker-step and for the server, what the PS counted, what the link carried, and what lies between: TCP's payload
sent once, its retransmissions, the headers of every packet (ACKs included), and drops at the queues.

    python experiments/compression/wire_counters.py CONFIG --out DIR [--set section.key=value ...]

Writes DIR/wire_counters.json (every snapshot) and DIR/wire_counters.md (the table). Needs root, as psarch's
emulated cluster does; the run's namespaces are the run's own and go with it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from psarch.cluster import emulated, netns

Snapshot = dict[str, Any]
SNAPSHOTS: list[Snapshot] = []
HEADERS = 14 + 20 + 32     # Ethernet, IPv4, TCP with timestamps: every packet of these links, data or ACK
TCP_EXT = ("TCPLostRetransmit", "TCPTimeouts", "TCPSpuriousRTOs", "TCPLossProbes", "TCPFastRetrans",
           "TCPSlowStartRetrans", "TCPSackRecovery", "TCPDSACKRecv", "TCPDSACKOfoRecv", "DelayedACKs",
           "TCPSACKReorder", "TCPLossFailures", "TCPRetransFail", "TCPSpuriousRtxHostQueues")


def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True).stdout


def _sockets(ns: str) -> dict[str, dict[str, Any]]:
    """{"local peer": tcp_info fields} of every TCP socket in `ns` (`ss -tinH`: a state line, then its info line)."""
    out: dict[str, dict[str, Any]] = {}
    key = None
    for line in _out("ip", "netns", "exec", ns, "ss", "-tinH").splitlines():
        if not line.startswith((" ", "\t")):
            f = line.split()
            key = f"{f[3]} {f[4]}" if len(f) >= 5 else None
            continue
        if key is None:
            continue
        info: dict[str, Any] = {}
        for k, v in re.findall(r"(\w+):(\S+)", line):
            if k == "retrans":               # current/total
                info["retrans_total"] = int(v.split("/")[-1])
            elif re.fullmatch(r"\d+", v):
                info[k] = int(v)
            else:
                info[k] = v
        info["cc"] = next((w for w in ("bbr", "cubic", "reno") if f" {w} " in f" {line} "), "?")
        out[key] = info
    return out


def _links(ns: str) -> dict[str, dict[str, int]]:
    links = json.loads(_out("ip", "-n", ns, "-s", "-j", "link", "show") or "[]")
    return {d["ifname"]: {f"{way}_{k}": d["stats64"][way][k] for way in ("tx", "rx")
                          for k in ("bytes", "packets", "dropped")} for d in links}


def _qdiscs(ns: str) -> list[dict[str, Any]]:
    keep = ("kind", "handle", "parent", "dev", "bytes", "packets", "drops", "overlimits", "requeues", "backlog", "qlen")
    return [{k: q.get(k) for k in keep} for q in json.loads(_out("tc", "-n", ns, "-s", "-j", "qdisc", "show") or "[]")]


def snapshot(c: emulated.EmulatedCluster) -> Snapshot:
    """Every namespace's TCP counters, sockets, links and qdiscs now."""
    snap: Snapshot = {"hub": {"links": _links(c.hub), "qdiscs": _qdiscs(c.hub)}, "nodes": {}}
    for n in c.nodes:
        snap["nodes"][n.ns] = {"mib": netns.tcp_counters(n.ns), "sockets": _sockets(n.ns), "links": _links(n.ns),
                               "qdiscs": _qdiscs(n.ns)}
    if not SNAPSHOTS:
        snap["congestion_control"] = {n.ns: _out("ip", "netns", "exec", n.ns, "sysctl", "-n",
                                                 "net.ipv4.tcp_congestion_control").strip() for n in c.nodes}
        snap["plan"] = [dict(n.to_dict(), port=n.port) for n in c.nodes]
    return snap


POLLS: list[dict[str, Any]] = []   # the hub's qdisc drops and port bytes every POLL_S, wall-clock stamped


POLL_S = 0.5


def _poll(stop: threading.Event) -> None:
    """Every POLL_S while a run's hub exists: each hub port's qdisc drops and bytes in from its node."""
    while not stop.wait(POLL_S):
        hubs = netns.names(f"{emulated.PREFIX}{os.getpid()}-hub")
        if not hubs:
            continue
        t = time.time()
        drops: dict[str, int] = {}
        for q in _qdiscs(hubs[0]):
            if q["kind"] == "bfifo":
                drops[q["dev"]] = drops.get(q["dev"], 0) + (q["drops"] or 0)
        links = _links(hubs[0])
        POLLS.append({"t": t, "drops": drops, "rx_bytes": {k: v["rx_bytes"] for k, v in links.items()}})


def per_step(run: Path) -> str:
    """Each step's time beside the drops at the hub's queues and the bytes into the hub while it ran (the polls
    between the first worker's start and the last worker's end of the step)."""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = ["| step | step (ms) | drops at the hub's queues (packets) | into the hub from the workers (KiB) |",
           "|---:|---:|---:|---:|"]
    for r in metrics:
        if not all("t_start" in w.get("extra", {}) for w in r["workers"]):   # the PS's workers say when a step ran
            continue
        t0 = min(w["extra"]["t_start"] for w in r["workers"])
        t1 = max(w["extra"]["t_end"] for w in r["workers"])
        inside = [p for p in POLLS if t0 - POLL_S <= p["t"] <= t1 + POLL_S]
        if len(inside) < 2:
            continue
        a, b = inside[0], inside[-1]
        drops = sum(b["drops"].values()) - sum(a["drops"].values())
        into = sum(b["rx_bytes"][k] - a["rx_bytes"].get(k, 0) for k in b["rx_bytes"] if k.startswith("w"))
        out.append(f"| {r['step']} | {r['step_time_s'] * 1e3:.1f} | {drops} | {into / 1024 / len(r['workers']):.1f} a worker |")
    return "\n".join(out) + "\n"


def _install() -> None:
    """Every read of the cluster's counters (start, the steps' marks, end) takes a snapshot beside it."""
    read = emulated.EmulatedCluster.counters

    def counters(self: emulated.EmulatedCluster) -> dict[str, tuple[int, int]]:
        out = read(self)
        SNAPSHOTS.append(snapshot(self))
        return out

    emulated.EmulatedCluster.counters = counters   # type: ignore[method-assign]


def _delta(a: dict[str, int], b: dict[str, int], key: str) -> int:
    return b.get(key, 0) - a.get(key, 0)


def _socket_delta(a: dict[str, dict], b: dict[str, dict], peer_prefix: str) -> dict[str, int]:
    """Summed change of the byte and segment counts of the sockets open at both reads whose peer starts so."""
    keys = ("bytes_sent", "bytes_retrans", "bytes_acked", "bytes_received", "segs_out", "data_segs_out",
            "segs_in", "data_segs_in", "retrans_total", "lost")
    out = dict.fromkeys(keys, 0)
    for k, s1 in b.items():
        s0 = a.get(k)
        if s0 is None or not k.split()[1].startswith(peer_prefix):
            continue
        for f in keys:
            out[f] += int(s1.get(f, 0)) - int(s0.get(f, 0))
    return out


def analyse(run: Path, snaps: list[Snapshot]) -> str:
    """The steps' window (snapshots at the two marks) per worker-step and for the server, as a markdown table."""
    summary = json.loads((run / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps, n = summary["steps"], summary["world_size"]
    a, b = (snaps[1], snaps[2]) if len(snaps) >= 4 else (snaps[0], snaps[-1])
    plan = snaps[0]["plan"]
    workers = [p for p in plan if p["role"] == "worker"]
    server = next((p for p in plan if p["role"] == "server"), None)
    counted = statistics.fmean(r["workers_sent"] for r in metrics) / n
    counted_in = statistics.fmean(r["workers_received"] for r in metrics) / n
    rows = []
    for w in workers:
        na, nb = a["nodes"][w["node"]], b["nodes"][w["node"]]
        ha, hb = a["hub"]["links"][w["port"]], b["hub"]["links"][w["port"]]
        link, packets = hb["rx_bytes"] - ha["rx_bytes"], hb["rx_packets"] - ha["rx_packets"]
        s = _socket_delta(na["sockets"], nb["sockets"], "10.213.")
        mib = {k: _delta(na["mib"], nb["mib"], k) for k in ("Tcp.OutSegs", "Tcp.RetransSegs", "Tcp.InSegs")}
        mib.update({k: _delta(na["mib"], nb["mib"], f"TcpExt.{k}") for k in TCP_EXT})
        rows.append({"link": link, "packets": packets, **s, **mib})
    mean = {k: statistics.fmean(r[k] for r in rows) / steps for k in rows[0]}
    first = mean["bytes_sent"] - mean["bytes_retrans"]
    headers = mean["link"] - mean["bytes_sent"]
    out = [f"# {run.name}: the steps' window, {steps} steps, N = {n}, per worker-step (mean of {len(rows)} workers)", "",
           "| what | bytes/step | KiB/step | share of link |", "|---|---:|---:|---:|"]

    def row(what: str, x: float) -> None:
        out.append(f"| {what} | {x:,.0f} | {x / 1024:.2f} | {x / mean['link']:.1%} |")

    row("counted by the backend (what its workers sent)", counted)
    row("TCP payload sent once, beyond the counted frames (ZMTP framing, heartbeats, the store)", first - counted)
    row("TCP payload retransmitted (tcpi_bytes_retrans)", mean["bytes_retrans"])
    row(f"headers of every packet ({mean['packets']:,.0f} packets: {mean['data_segs_out']:,.0f} with data)", headers)
    row("on the worker's link (sent)", mean["link"])
    out += ["", "TCP's counters per worker-step (the worker's namespace):", "",
            "| counter | per worker-step |", "|---|---:|"]
    out += [f"| {k} | {mean[k]:,.2f} |" for k in ("Tcp.OutSegs", "Tcp.RetransSegs", "Tcp.InSegs", "data_segs_out",
                                                   "retrans_total", *TCP_EXT) if k in mean]
    out += ["", f"The PS counted {counted_in / 1024:.2f} KiB received a worker-step."]
    if server is not None:
        ha, hb = a["hub"]["links"][server["port"]], b["hub"]["links"][server["port"]]
        recv = (hb["tx_bytes"] - ha["tx_bytes"]) / steps
        sent_by_workers = sum(r["link"] for r in rows) / steps
        out += ["", f"Server {server['node']}: received {recv / 1024:.2f} KiB a step on its link; the workers' links "
                    f"carried {sent_by_workers / 1024:.2f} KiB a step towards the hub (difference "
                    f"{(sent_by_workers - recv) / 1024:.2f} KiB: dropped at the hub's queues, and what went elsewhere)."]
    out += ["", "Drops at the qdiscs over the window (packets; qdiscs with none left out):", "",
            "| namespace | dev | qdisc | parent | drops | overlimits | sent packets |", "|---|---|---|---|---:|---:|---:|"]
    places = [("hub", a["hub"]["qdiscs"], b["hub"]["qdiscs"])]
    places += [(ns, a["nodes"][ns]["qdiscs"], b["nodes"][ns]["qdiscs"]) for ns in b["nodes"]]
    for name, qa, qb in places:
        before = {(q["dev"], q["handle"], q["parent"]): q for q in qa}
        for q in qb:
            q0 = before.get((q["dev"], q["handle"], q["parent"]), {})
            drops = (q["drops"] or 0) - (q0.get("drops") or 0)
            if drops:
                out.append(f"| {name} | {q['dev']} | {q['kind']} {q['handle']} | {q['parent']} | {drops} | "
                           f"{(q['overlimits'] or 0) - (q0.get('overlimits') or 0)} | "
                           f"{(q['packets'] or 0) - (q0.get('packets') or 0)} |")
    st = summary.get("cluster", {}).get("step_time", {})
    cc = sorted(set(snaps[0]["congestion_control"].values()))
    out += ["", f"Step: measured {st.get('measured_s', float('nan')) * 1e3:.1f} ms | predicted "
                f"{st.get('predicted_s', float('nan')) * 1e3:.1f} ms; D = {summary['cluster'].get('dilation')}; "
                f"congestion control in the nodes: {', '.join(cc)}; snapshots: {len(snaps)}."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)
    _install()
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(stop,), daemon=True)
    poller.start()
    from psarch import cli
    code = cli.main(["run", args.config, "--out", args.out, "--overwrite", "--quiet",
                     *[x for o in args.overrides for x in ("--set", o)]])
    stop.set()
    poller.join()
    out = Path(args.out)
    (out / "wire_counters.json").write_text(json.dumps({"snapshots": SNAPSHOTS, "polls": POLLS}))
    left = netns.names(f"{emulated.PREFIX}{os.getpid()}-")   # this run's own: none once it ended
    if code == 0 and len(SNAPSHOTS) >= 2:
        table = analyse(out, SNAPSHOTS) + "\nPer step (the hub polled every 0.5 s, wall clock):\n\n" + per_step(out)
        (out / "wire_counters.md").write_text(table)
        print(table)
    print(f"psarch exit {code}; this run's namespaces left: {left or 'none'}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
