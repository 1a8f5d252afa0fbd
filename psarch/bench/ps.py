"""PS benchmark: `psarch bench ps [--max-mib 256] [--steps 30] [--skip-steps]`.

1. Wire throughput. One worker and one server process on loopback TCP; per round the worker pushes a
   parameter-sized vector and pulls one back in one request and its reply (push + pull = 2·size
   bytes), as PS workers do each step. Servers:
   - `raw pyzmq`: DEALER/ROUTER, one frame per direction, zero-copy send, the received bytes copied
     once into the destination buffer (as any consumer must); `raw 4MiB`: the same bytes in 4 MiB
     frames, the framing the PS wire uses (single huge frames cost ZeroMQ a fresh allocation, i.e.
     page faults, per message);
   - `ps wire`: the same through psarch.ps.wire and the worker's PSClient (msgpack header, ~4 MiB
     frames, validation), the server only decoding into / encoding from its buffer;
   - `ps server`: the real ParameterServer (sync, one worker, SGD step on its range every round), the range
     whole (partition_mb = 0), with each `backend.auth`: none, plain (PLAIN handshake, then clear frames)
     and curve (every frame encrypted and authenticated by CurveZMQ); and `parts`: auth none, the range in
     partitions of `--partition-mb` (default: backend.partition_mb's), pushed back to back and pipelined.
   The ratios that matter are ps wire / raw pyzmq (target >= 0.8), what CURVE costs (curve / none) and
   what partitions cost or gain on loopback (parts / none, target >= 1).
2. Step time of `ps` sync (1 server) with each auth against `ddp` (native) on the same small GPT, N = 2:
   median step time after warm-up from each run's summary.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import tempfile
import time
from typing import Any, TypedDict

import numpy as np
import torch
import zmq

from psarch.config.files import Table
from psarch.ps import wire
from psarch.ps.layout import partitions
from psarch.ps.worker.client import PSClient, Request

AUTHS = ("none", "plain", "curve")   # backend.auth values compared (curve: fresh per-run keys)


def _raw_server(conn: Any) -> None:
    zctx = zmq.Context()
    sock = zctx.socket(zmq.ROUTER)
    conn.send_bytes(str(sock.bind_to_random_port("tcp://127.0.0.1")).encode())
    buf = np.empty(0, np.uint8)
    while True:
        ident, op, *rest = sock.recv_multipart(copy=False)
        if op.bytes == b"pushpull":
            chunk = len(rest[0])
            n = sum(len(f) for f in rest)
            if buf.size != n:
                buf = np.empty(n, np.uint8)
            pos = 0
            for f in rest:
                buf[pos:pos + len(f)] = np.frombuffer(f.buffer, np.uint8)
                pos += len(f)
            sock.send_multipart([ident, b"params", *(buf.data[i:i + chunk] for i in range(0, n, chunk))],
                                copy=False)
        else:
            break
    sock.close(linger=0)
    zctx.term()


def _wire_server(conn: Any) -> None:
    zctx = zmq.Context()
    sock = zctx.socket(zmq.ROUTER)
    conn.send_bytes(str(sock.bind_to_random_port("tcp://127.0.0.1")).encode())
    buf = torch.empty(0)
    while True:
        ident, *body = sock.recv_multipart(copy=False)
        msg = wire.decode(body)
        if msg.op == "pushpull":
            if buf.numel() != msg.numel:
                buf = torch.empty(msg.numel)
            msg.tensor(buf)
            reply = wire.encode({"op": "params", "version": 1, "offset": 0}, buf)
        else:
            sock.send_multipart([ident, *wire.encode({"op": "ack", "version": 1})])
            break
        sock.send_multipart([ident, *reply], copy=False)
    sock.close(linger=0)
    zctx.term()


def _start(target: Any) -> tuple[Any, str]:
    parent, child = mp.Pipe()
    p = mp.get_context("spawn").Process(target=target, args=(child,), daemon=True)
    p.start()
    return p, f"tcp://127.0.0.1:{int(parent.recv_bytes())}"


class _Raw:
    """The raw pyzmq worker: the vector out in one request, back in the reply, copied into the destination."""

    def __init__(self, addr: str, n: int, chunk: int | None = None) -> None:
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.DEALER)
        self.sock.connect(addr)
        self.src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
        self.dst = np.empty(n, np.uint8)
        self.chunk = chunk or n
        self.frames = [self.src.data[i:i + self.chunk] for i in range(0, n, self.chunk)]

    def round(self) -> None:
        self.sock.send_multipart([b"pushpull", *self.frames], copy=False)
        _, *frames = self.sock.recv_multipart(copy=False)
        pos = 0
        for f in frames:
            self.dst[pos:pos + len(f)] = np.frombuffer(f.buffer, np.uint8)
            pos += len(f)

    def close(self, stop: bool = False) -> None:
        if stop:
            self.sock.send_multipart([b"stop"])
        self.sock.close(linger=1000)
        self.zctx.term()


class _PS:
    """The PS worker's wire path: PSClient pushing a gradient and pulling parameters, in partitions of `elems`
    elements sent back to back (0: one message each way), as a worker's ServerLink does."""

    def __init__(self, addr: str, n: int, init: bool, creds: dict | None = None, elems: int = 0) -> None:
        self.client = PSClient([addr], 0, timeout_s=120.0, creds=creds)
        numel = n // 4
        self.grad, self.dst = torch.randn(numel), torch.empty(numel)
        if init:
            self.client.exchange([[Request({"op": "init", "numel": numel, "offset": 0}, torch.zeros(numel))]])
        self.parts = partitions(0, numel, elems)
        self.step = 0

    def round(self) -> None:
        self.client.exchange([[Request({"op": "pushpull", "step": self.step, "version": self.step, "offset": a},
                                       self.grad[a:b], into=self.dst[a:b]) for a, b in self.parts]])
        self.step += 1

    def close(self, stop: bool = False) -> None:
        if stop:
            self.client.exchange([[Request({"op": "done"})]], timeout_s=10)
        self.client.close()


def _interleaved(clients: dict[str, _Raw | _PS], nbytes: int, min_s: float = 2.0) -> dict[str, float]:
    """Bytes per second (push + pull) of each client, rounds taken in turn (in a shuffled order) so that
    all see the same machine load: one warm-up each, then at least 7 rounds each and `min_s` seconds in
    all; medians."""
    times: dict[str, list[float]] = {k: [] for k in clients}
    for c in clients.values():
        c.round()
    t_start = time.perf_counter()
    order, rng = list(clients), random.Random(0)
    while min(len(v) for v in times.values()) < 7 or time.perf_counter() - t_start < min_s:
        rng.shuffle(order)  # a round right after another server's round may share the cores with its tail
        for k in order:
            t0 = time.perf_counter()
            clients[k].round()
            times[k].append(time.perf_counter() - t0)
    return {k: 2 * nbytes / statistics.median(v) for k, v in times.items()}


def wire_table(max_mib: int, partition_mb: float | str) -> list[dict[str, float]]:
    from psarch.config import from_dict
    from psarch.ps.layout import partition_elems
    from psarch.ps.services import start_services

    sizes = [m * 2**20 for m in (1, 4, 16, 64, 256) if m <= max_mib]
    raw_p, raw_addr = _start(_raw_server)
    wire_p, wire_addr = _start(_wire_server)
    servers = {a: (a, 0.0) for a in AUTHS} | {"parts": ("none", partition_mb)}
    table = []
    try:
        for n in sizes:
            cfgs = {k: from_dict({"train": {"optimizer": "sgd", "lr": 0.0}, "backend": {
                "kind": "ps", "world_size": 1, "mode": "sync", "timeout_s": 120.0, "auth": a, "partition_mb": mb}})
                for k, (a, mb) in servers.items()}
            services = {k: start_services(c, None, build_model=False) for k, c in cfgs.items()}
            clients: dict[str, _Raw | _PS] = {"raw": _Raw(raw_addr, n),
                                               "raw_chunked": _Raw(raw_addr, n, wire.CHUNK),
                                               "wire": _PS(wire_addr, n, init=False)}
            clients.update({f"server_{k}": _PS(sv.info.addresses[0], n, init=True, creds=sv.info.auth,
                                               elems=partition_elems(cfgs[k], n // 4))
                            for k, sv in services.items()})
            try:
                table.append(dict(mib=n / 2**20, **_interleaved(clients, n)))
            finally:
                last = n == sizes[-1]
                for c in clients.values():
                    c.close(stop=last and c in (clients["raw"], clients["wire"]))
                for sv in services.values():
                    sv.stop()
    finally:
        for p in (raw_p, wire_p):
            p.join(10)
            if p.is_alive():
                p.terminate()
    return table


class StepTimeRow(TypedDict):
    """One backend's run in the step-time table."""

    backend: str
    step_ms: float
    comm_ms: float
    params: int
    final_loss: float | None


def step_table(steps: int) -> list[StepTimeRow]:
    import psarch
    from psarch.config import from_dict

    base: Table = {"seed": 0, "workload": {"model": "gpt", "data": "markov", "seq_len": 32,
                                    "gpt": {"n_layer": 2, "n_embd": 64, "n_head": 4}},
            "train": {"steps": steps, "global_batch": 16, "optimizer": "adamw", "lr": 3e-3, "log_every": 10**6}}
    table: list[StepTimeRow] = []
    runs: list[tuple[str, Table]] = [("ddp (native)", {"kind": "ddp", "comm": "native"})]
    runs += [(f"ps sync, auth {a}", {"kind": "ps", "mode": "sync", "servers": 1, "auth": a}) for a in AUTHS]
    for label, backend in runs:
        cfg = from_dict(dict(base, name=label.split()[0], backend=dict(backend, world_size=2)))
        with tempfile.TemporaryDirectory() as out:
            s = psarch.run(cfg, out, echo=False)
        table.append({"backend": label, "step_ms": s["step_time_s"] * 1e3, "comm_ms": s["comm_s"] * 1e3,
                      "params": s["params"], "final_loss": s["final_loss"]})
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="psarch bench ps", description=__doc__.splitlines()[0])
    ap.add_argument("--max-mib", type=int, default=256, help="largest parameter vector, MiB (1, 4, 16, 64, 256)")
    ap.add_argument("--steps", type=int, default=40, help="training steps per backend in the step-time table")
    ap.add_argument("--skip-steps", action="store_true", help="only the wire table")
    ap.add_argument("--partition-mb", type=lambda v: v if v == "auto" else float(v), default="auto",
                    help="the `parts` server's partitions, MiB, or 'auto' (backend.partition_mb's default)")
    ap.add_argument("--json", help="also write the tables to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    wire_rates = wire_table(args.max_mib, args.partition_mb)
    print("push+pull throughput, 1 worker <-> 1 server, loopback TCP (GB/s = 1e9 bytes/s, push + pull bytes)")
    print(f"{'size':>8} {'raw pyzmq':>10} {'raw 4MiB':>9} {'ps wire':>8} {'ratio':>6} {'vs 4MiB':>7} "
          f"{'server none':>12} {'plain':>6} {'curve':>6} {'curve/none':>10} {'parts':>6} {'parts/none':>10}")
    for r in wire_rates:
        print(f"{r['mib']:>4.0f} MiB {r['raw'] / 1e9:>10.2f} {r['raw_chunked'] / 1e9:>9.2f} {r['wire'] / 1e9:>8.2f} "
              f"{r['wire'] / r['raw']:>6.2f} {r['wire'] / r['raw_chunked']:>7.2f} "
              f"{r['server_none'] / 1e9:>12.2f} {r['server_plain'] / 1e9:>6.2f} {r['server_curve'] / 1e9:>6.2f} "
              f"{r['server_curve'] / r['server_none']:>10.2f} {r['server_parts'] / 1e9:>6.2f} "
              f"{r['server_parts'] / r['server_none']:>10.2f}")
    print("ratio = ps wire / raw pyzmq (one frame per direction); vs 4MiB = ps wire / raw pyzmq sending the same "
          "4 MiB frames; server none/plain/curve: the real server with that backend.auth, the range whole (GB/s); "
          f"parts: auth none, in partitions of {args.partition_mb} MiB")
    steps = [] if args.skip_steps else step_table(args.steps)
    if steps:
        print(f"\nstep time, N = 2, gpt 2x64 on markov ({steps[0]['params']:,} params), median after warm-up")
        print(f"{'backend':>20} {'step ms':>9} {'comm ms':>9} {'vs ddp':>7}")
        for row in steps:
            ratio = row["step_ms"] / steps[0]["step_ms"]
            print(f"{row['backend']:>20} {row['step_ms']:>9.2f} {row['comm_ms']:>9.2f} {ratio:>7.2f}")
    print(f"\n(benchmark took {time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wire": wire_rates, "steps": steps}, f, indent=2)
    return 0

