"""What the emulated network delivers to bulk TCP, without psarch's backends: N worker and K server nodes of an
EmulatedCluster (the same namespaces, veths and tbf qdiscs a run gets), every worker sending BYTES to every server
at once and, with duplex, every server sending BYTES back to every worker at the same time (a PS's pushes and pulls
pipelined), each pair on one TCP connection as a PS worker's link to a server. Prints the slowest worker's time
(until every byte it sent is received and every byte it is owed has arrived) over the ideal: K x BYTES (x N / K at
a server) at the link rate, with 1514 / 1448 bytes on the wire per payload byte. Needs root.
    python experiments/cluster_crossover_device/duplex_flows.py N K MBPS BYTES DUPLEX(0|1)"""
import subprocess
import sys
from pathlib import Path

from psarch.cluster.emulated import EmulatedCluster

PORT = 47000
RX = ("def rx(c, b):\n    got, buf = 0, bytearray(1 << 20)\n"
      "    while got < b:\n        got += c.recv_into(buf, min(len(buf), b - got))\n")
SERVER = RX + r'''
import socket, sys, threading
n, b, duplex, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
srv = socket.create_server(("0.0.0.0", port))
conns = [srv.accept()[0] for _ in range(n)]
ts = [threading.Thread(target=rx, args=(c, b)) for c in conns]
ts += [threading.Thread(target=c.sendall, args=(bytes(b),)) for c in conns] if duplex else []
[t.start() for t in ts]; [t.join() for t in ts]
[c.sendall(b"k") for c in conns]      # everything this worker sent has arrived
[c.recv(1) for c in conns]
'''
WORKER = RX + r'''
import socket, sys, threading, time
addrs, b, duplex, port = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
time.sleep(1.0)
conns = [socket.create_connection((a, port)) for a in addrs]
t0 = time.perf_counter()
ts = [threading.Thread(target=c.sendall, args=(bytes(b),)) for c in conns]
ts += [threading.Thread(target=rx, args=(c, b)) for c in conns] if duplex else []
[t.start() for t in ts]; [t.join() for t in ts]
[c.recv(1) for c in conns]
print(time.perf_counter() - t0, flush=True)
[c.sendall(b"x") for c in conns]
'''


def exec_in(node, code: str, *args) -> list[str]:
    """The command that runs Python `code` with `args` inside `node`'s namespace."""
    return ["ip", "netns", "exec", node.ns, sys.executable, "-c", code, *map(str, args)]


def main() -> None:
    n, k, mbps, nbytes, duplex = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    c = EmulatedCluster(n, k, mbps, mbps)
    try:
        servers = [x for x in c.nodes if x.role == "server"]
        workers = [x for x in c.nodes if x.role == "worker"]
        sp = [subprocess.Popen(exec_in(s, SERVER, n, nbytes, duplex, PORT)) for s in servers]
        wp = [subprocess.Popen(exec_in(w, WORKER, ",".join(s.address for s in servers), nbytes, duplex, PORT),
                               stdout=subprocess.PIPE, text=True) for w in workers]
        times = [float(p.communicate()[0]) for p in wp]
        for p in sp:
            p.wait()
    finally:
        c.close()
    ideal = k * nbytes * max(1.0, n / k) * 8 * 1514 / 1448 / (mbps * 1e6)
    cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    print(f"N={n} K={k} {mbps:g} Mbit/s {nbytes} B a pair {'both ways' if duplex == '1' else 'one way'} ({cc}): "
          f"slowest {max(times):.2f} s, ideal {ideal:.2f} s, ratio {max(times) / ideal:.2f}")


if __name__ == "__main__":
    main()
