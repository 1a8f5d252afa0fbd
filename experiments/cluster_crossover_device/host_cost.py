"""This host's own cost per PS message: the PS's per-message and per-partition work on this machine.

One real ParameterServer (its own process, sync, `--workers` workers, backend.auth "auto": PLAIN on loopback) and
the workers' PSClients in this process, on loopback TCP. A round is what each worker does each step: a `pushpull`
per partition, all sent back to back, then every `params` reply taken into its flat buffer (a partition's pull is
answered once every worker pushed it, so the server holds up to workers x partitions waiting pulls). Partitions are
PARTITION_ALIGN (64) fp32 elements, 256 bytes, so the bytes cost nothing and what is left is the per-message
work: msgpack framing, validation, the server's handler and update, ZeroMQ, the wake-ups.

Per message (one worker's request for one partition, and its reply): wall time of a round / messages, and the CPU
time of the workers' process and of the server's process (/proc, every thread: ZeroMQ's I/O threads, the server's
watchdog and ZAP threads, also by thread name) over the same rounds; medians of `--repeats` runs of `--rounds`
rounds each. Also, in this process alone: wire.encode + wire.decode + the payload copied out with its inf/nan
check, of one partition's pushpull (`wire_ns`, ns per message).

It uses only what psarch has had since before these were measured, so the same script times any such checkout:
    PYTHONPATH=/path/to/checkout python experiments/cluster_crossover_device/host_cost.py --partitions 64 256
Results: results/host_cost.md.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from psarch.config import Config

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of process `pid` so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of process `pid` so far, summed by thread name (ZMQbg/IO/0, python, ...)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name, fields = text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def _config(workers: int) -> Config:
    from psarch.config import from_dict
    return from_dict({"train": {"optimizer": "sgd", "lr": 0.0},
                      "backend": {"kind": "ps", "world_size": workers, "servers": 1, "mode": "sync", "timeout_s": 60.0,
                                  "partition_mb": 64 * 4 / 2**20, "partition_assignment": "ranges"}})


def _server(conn: Any, workers: int, creds: dict, profile: str) -> None:
    """A server of its own process, serving until the launcher-side pipe says stop (cProfile'd into `profile`)."""
    from psarch.ps.auth import Credentials
    from psarch.ps.server.start import build_server
    torch.set_num_threads(1)
    server = build_server(0, _config(workers), "127.0.0.1", 0, build=False, pipe=conn,
                          creds=Credentials.from_dict(creds))
    conn.send_bytes(json.dumps({"event": "ready", "address": server.address}).encode())
    if profile:
        import cProfile
        cProfile.runctx("server.serve()", globals(), {"server": server}, profile)
    else:
        server.serve()


def ps_rounds(partitions: int, workers: int, rounds: int, repeats: int, profile: str = "") -> dict[str, float]:
    """Microseconds per partition message (wall, workers' CPU, server CPU; `workers` workers each send every
    partition, all from this process): medians over `repeats` runs of `rounds`."""
    from psarch.ps.auth import run_credentials
    from psarch.ps.worker.client import PSClient, Request
    cfg = _config(workers)
    creds, folder = run_credentials(cfg, "127.0.0.1")
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_server, args=(child, workers, creds.to_dict(), profile + ".server"
                                                                 if profile else ""), daemon=True)
    proc.start()
    address = json.loads(parent.recv_bytes())["address"]
    pid = proc.pid
    assert pid is not None   # started
    numel = 64 * partitions
    clients = [PSClient([address], w, timeout_s=60.0, creds=creds) for w in range(workers)]
    grad, flats = torch.randn(numel), [torch.empty(numel) for _ in clients]
    bounds = [(a, a + 64) for a in range(0, numel, 64)]
    clients[0].exchange([[Request({"op": "init", "numel": numel, "offset": 0}, torch.zeros(numel))]])
    step = 0

    def round_() -> None:
        nonlocal step
        for client, flat in zip(clients, flats):
            for a, b in bounds:
                client.post(0, Request({"op": "pushpull", "step": step, "version": step, "offset": a}, grad[a:b],
                                       into=flat[a:b]))
        for client in clients:
            client.wait()
        step += 1

    for _ in range(3):
        round_()
    walls, worker_cpu, server_cpu = [], [], []
    threads0 = threads_cpu_s(pid)
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    for _ in range(repeats):
        w0, s0, t0 = time.process_time(), cpu_s(pid), time.perf_counter()
        for _ in range(rounds):
            round_()
        t1, w1, s1 = time.perf_counter(), time.process_time(), cpu_s(pid)
        n = rounds * partitions * workers / 1e6
        walls.append((t1 - t0) / n)
        worker_cpu.append((w1 - w0) / n)
        server_cpu.append((s1 - s0) / n)
    threads1 = threads_cpu_s(pid)
    per = {f"server_{k}_us": (threads1[k] - threads0.get(k, 0.0)) / (repeats * rounds * partitions * workers) * 1e6
           for k in threads1 if threads1[k] - threads0.get(k, 0.0) > 0}
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile + ".worker")
    for client in clients:
        client.exchange([[Request({"op": "done"})]])
        client.close()
    parent.send_bytes(json.dumps({"cmd": "stop"}).encode())
    proc.join(10)
    if proc.is_alive():
        proc.terminate()
    from psarch.ps.auth import remove
    remove(folder)
    return {"wall_us": statistics.median(walls), "worker_cpu_us": statistics.median(worker_cpu),
            "server_cpu_us": statistics.median(server_cpu), **per}


def wire_ns(messages: int = 20000) -> float:
    """ns per message of wire.encode + wire.decode of one 64-element pushpull (this process alone)."""
    from psarch.ps import wire
    t = torch.randn(64)
    header = {"op": "pushpull", "worker": 0, "step": 3, "version": 3, "offset": 128}
    out = torch.empty(64)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(messages):
            wire.decode(wire.encode(header, t)).tensor(out, finite=True)
        times.append((time.perf_counter() - t0) / messages * 1e9)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partitions", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--workers", type=int, default=4, help="workers (PSClients in this process) of the one server")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", default="", help="cProfile the worker and the server into PREFIX.worker/.server")
    ap.add_argument("--label", default="", help="a name for this checkout in the output")
    args = ap.parse_args()
    torch.set_num_threads(1)
    row: dict[str, object] = {"label": args.label, "load": open("/proc/loadavg").read().split()[0],
                              "wire_ns": round(wire_ns())}
    for p in args.partitions:
        r = ps_rounds(p, args.workers, args.rounds, args.repeats, f"{args.profile}.{p}" if args.profile else "")
        row[f"P{p}"] = {k: round(v, 1) for k, v in r.items()}
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
