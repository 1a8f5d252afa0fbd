"""A parameter server refuses every malformed or out-of-turn message and changes nothing: fuzzing over every
mode, spoken to a live server (threads of the test process) over raw DEALER sockets."""
from __future__ import annotations

import random
import time

import msgpack
import pytest
import torch
import zmq

from psarch.config import from_dict
from psarch.ps import auth, wire
from psarch.ps.auth import Credentials
from psarch.ps.worker.client import PSClient, Request
from psarch.ps.layout import partition_elems, partitions
from psarch.ps.services import start_services
from psarch.workload import build_workload
from ps_setup import config, ps
from timing import scaled


def _malformed(rng: random.Random, count: int, n: int, whole: int) -> list[list[bytes]]:
    """`count` messages a server must refuse, of many kinds; each push differs from a valid one (worker 0,
    step 0, version 0, the first partition: `n` parameters of the server's `whole`) in one respect. Worker 1
    has pushed step 0 already, so its repeated or out-of-order pushes and pulls beyond either worker's next
    step are refused too."""
    good = {"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0, "dtype": "float32", "shape": [n],
            "frames": 1}
    payload = bytes(4 * n)

    def push(**over):
        h = dict(good)
        for k, v in over.items():
            if v is None:
                h.pop(k, None)
            else:
                h[k] = v
        return msgpack.packb(h)

    def pull(worker, step):
        return [msgpack.packb({"op": "pull", "worker": worker, "step": step, "want": "float32"})]

    kinds = [
        lambda: [rng.randbytes(rng.randint(1, 300))],
        lambda: [rng.randbytes(rng.randint(0, 50)) for _ in range(rng.randint(2, 6))],
        lambda: [msgpack.packb({"op": rng.choice(["", "PUSH", "shutdown", "stop", "stats", "ack", "params",
                                                  "error", "lost", rng.randbytes(4).hex()]), "worker": 0})],
        lambda: [push(dtype=rng.choice(["float16", "bfloat16", "int64", "float64", "bool"])), payload],
        lambda: [push(shape=[n + rng.choice([-1, 1, 7])]), payload],
        lambda: [push(shape=[n], offset=rng.randint(1, 10**6)), payload],
        lambda: [push(shape=[whole]), bytes(4 * whole)] if whole != n else [push(shape=[n + 1]), payload],
        lambda: [push(offset=rng.randint(1, n - 1)), payload],                          # inside a partition
        lambda: [push(frames=rng.choice([0, 2, 5])), payload],
        lambda: [push()],
        lambda: [push(), payload, rng.randbytes(8)],
        lambda: [push(), payload[:rng.randint(0, len(payload) - 1)]],
        lambda: [push(**{rng.choice(["worker", "step", "version", "offset", "op"]): None}), payload],
        lambda: [push(**{rng.choice(["worker", "step", "version"]): rng.choice([-1, 1.5, "x", True, [1]])}), payload],
        lambda: [push(worker=rng.randint(2, 1000)), payload],
        lambda: [push(version=rng.randint(1, 100)), payload],
        lambda: [push(step=rng.randint(1, 100)), payload],
        lambda: [push(colour="blue"), payload],
        lambda: [push(op="pushpull", **{rng.choice(["dtype", "shape", "version"]): rng.choice(["int8", [3], 99])}),
                 payload],
        lambda: [push(op="pushpull", worker=rng.randint(2, 99)), payload],
        lambda: [msgpack.packb(rng.choice([[1, 2], 7, "push", None, b"\x00"]))],
        lambda: [msgpack.packb({"op": "init", "worker": 0, "numel": n, "offset": 0, "dtype": "float32",
                                "shape": [n], "frames": 1}), payload],
        lambda: [msgpack.packb({"op": "pull", "worker": 1, "step": 0, "want": rng.choice(["float16", "x", ""])})],
        lambda: [msgpack.packb({"op": "fetch", "worker": 9})],
        # semantic: well-formed, but not what this worker may send now
        lambda: [push(worker=1, op=rng.choice(["push", "pushpull"])), payload],          # repeated push
        lambda: [push(worker=1, step=rng.choice([2, 3, 99])), payload],                  # skips a step
        lambda: pull(0, rng.choice([1, 2, 10**6, 2**62])),                                # future pull
        lambda: pull(1, rng.choice([2, 3, 10**6])),
        lambda: [push(scale=rng.choice([0.0, -1.0, 1e-300, 3.0, 1.0, 65536.0, 0])), payload],  # fp32: no scale
        lambda: [push(found_inf=rng.choice([True, False])), payload],
    ]
    return [rng.choice(kinds)() for _ in range(count)]


def _named_worker(header: bytes) -> object:
    """The worker a fuzzed header frame names, if it is a msgpack map naming one."""
    try:
        h = msgpack.unpackb(header)
    except Exception:
        return None
    return h.get("worker") if isinstance(h, dict) and isinstance(h.get("worker"), int) else None


FUZZ_MODES = {"sync": {}, "async": {}, "ssp": {"staleness_bound": 0}, "geo": {}, "geo-barrier": {"geo_barrier": True},
              # each a range in partitions of 256 elements (a push names one by its offset)
              "sync-parts": {"partition_mb": 0.001}, "ssp-parts": {"staleness_bound": 0, "partition_mb": 0.001},
              "geo-barrier-parts": {"geo_barrier": True, "partition_mb": 0.001}}


def _partitioned(cfg, numel: int) -> list[tuple[int, int]]:
    """The partitions of a one-server run's range."""
    return partitions(0, numel, partition_elems(cfg, numel))


@pytest.mark.parametrize("mode", list(FUZZ_MODES))
def test_fuzzed_messages_are_refused_and_change_nothing(mode):
    """Malformed, random and out-of-turn messages to a live server (worker 1 has pushed step 0): each
    gets an error reply, the parameters do not move, the server then serves a normal worker (and
    survives a frame over its size limit). Plain SGD, lr 0.5, so the final update is known."""
    extra, count = FUZZ_MODES[mode], 1200
    # worker 0 speaks through three sockets here (a fuzzer, the oversized frame's, a client)
    cfg = from_dict(config("fuzz", train={"optimizer": "sgd", "lr": 0.5},
                           backend=ps(2, mode.split("-")[0], timeout_s=60.0, max_connections_per_worker=4, **extra)))
    services = start_services(cfg, None, threads=True)
    addr = services.info.addresses
    zctx = zmq.Context()
    # authenticated peers that send garbage: the fuzzer of worker w sends the messages naming worker w
    # (worker 0's sends the rest), so the semantic checks, not only the identity check, are reached
    fuzzers = {w: zctx.socket(zmq.DEALER) for w in (0, 1)}
    big = zctx.socket(zmq.DEALER)
    creds = services.info.auth
    w0, w1 = PSClient(addr, 0, 10.0, creds), PSClient(addr, 1, 10.0, creds)
    try:
        for w, sock in [*fuzzers.items(), (0, big)]:
            sock.setsockopt(zmq.LINGER, 0)
            auth.client_socket(sock, Credentials.from_dict(creds), w, 0)
            sock.connect(addr[0])
        numel = sum(p.numel() for p in build_workload(cfg).model.parameters())
        parts = _partitioned(cfg, numel)
        init, base = torch.empty(numel), torch.empty(numel)
        w0.exchange([[Request({"op": "fetch"}, into=init)]])   # the server built the model itself
        g1 = torch.randn(numel)
        w1.exchange([[Request({"op": "push", "step": 0, "version": 0, "offset": a}, g1[a:b]) for a, b in parts]])
        w0.exchange([[Request({"op": "fetch"}, into=base)]])
        messages = _malformed(random.Random(0), count, parts[0][1], numel)
        t0 = time.monotonic()
        for frames in messages:
            fuzzer = fuzzers.get(_named_worker(frames[0]), fuzzers[0])
            fuzzer.send_multipart(frames)
            assert fuzzer.poll(int(scaled(5) * 1000)), f"no reply to {frames!r:.200}"
            reply = wire.decode(fuzzer.recv_multipart())
            assert reply.op == "error", frames
        assert time.monotonic() - t0 < scaled(30)
        big.send_multipart([b"x" * (wire.CHUNK + wire.MAX_HEADER + 1)])   # over MAXMSGSIZE: dropped
        now = torch.empty(numel)
        w0.exchange([[Request({"op": "fetch"}, into=now)]])
        assert torch.equal(now, base), "a refused message changed the parameters"
        # a normal worker is still served: its gradient (or delta) is applied
        g0 = torch.randn(numel)
        w0.exchange([[Request({"op": "push", "step": 0, "version": 0, "offset": a}, g0[a:b]) for a, b in parts]
                     + [Request({"op": "pull", "step": 1, "want": "float32", "offset": a}, into=now[a:b])
                        for a, b in parts]])
        expected = {"sync": init - 0.5 * (g1 + g0) / 2, "async": base - 0.5 * g0, "ssp": base - 0.5 * g0,
                    "geo": base + g0, "geo-barrier": init + g1 + g0}[mode.removesuffix("-parts")]
        torch.testing.assert_close(now, expected)
        detail = services.finish()["servers_detail"][0]
        assert detail["rejected"] == len(messages) and detail["version"] == (1 if mode.removesuffix("-parts") in ("sync", "geo-barrier")
                                                                              else 2)
    finally:
        for c in (w0, w1):
            c.close()
        for sock in fuzzers.values():
            sock.close(linger=0)
        big.close(linger=0)
        zctx.term()
        services.stop()
