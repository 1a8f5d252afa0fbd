"""The resident memory of a parameter-server process under issue 20's attacks by one worker's credentials (not
collected by pytest; run by hand, before and after a change to psarch/ps/server/connections.py):

    PYTHONPATH=. python tests/pressure_rss.py [attack ...]

Each attack gets a fresh server process (a 1.13 M-parameter MLP, one server, PLAIN, default bounds) and prints
the server's RSS before, its peak during, and what it still holds 1.5 s after the attackers closed:
multiframe_256 / multiframe_1024 (one message of 64 KiB frames from a ZeroMQ DEALER), slow_senders (four
raw peers each trickling 128 MiB of one message, never finished), unread (200 fetches whose replies are never
read), empty_frames (one raw peer sending 64 MiB of one message in empty frames, never finished)."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import msgpack
import zmq

sys.path.insert(0, str(Path(__file__).parent))
from ps_setup import config, ps  # noqa: E402
from zmtp_raw import RawPeer, frame  # noqa: E402

from psarch.config import from_dict  # noqa: E402
from psarch.ps import auth  # noqa: E402
from psarch.ps.auth import Credentials  # noqa: E402
from psarch.ps.services import start_services  # noqa: E402

MiB = 2**20
FETCH = msgpack.packb({"op": "fetch", "worker": 0})


def rss(pid: int) -> float:
    return int(next(x for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS")).split()[1]) / 1024


class Peak:
    """Samples a process's RSS every 10 ms in a thread; `peak` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.peak = max(self.peak, rss(self.pid))
            except (OSError, StopIteration):
                return

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def multiframe(address: str, creds: Credentials, total_mb: int) -> list:
    """One message of total_mb MiB in 64 KiB frames, from an authenticated DEALER (the frames share one buffer)."""
    zctx = zmq.Context()
    d = zctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    auth.client_socket(d, creds, 0, 0)
    d.connect(address)
    body = bytes(64 * 1024)
    d.send_multipart([FETCH] + [body] * (total_mb * 16), copy=False)
    d.poll(5000)
    return [zctx, d]


def slow_senders(port: int, password: str) -> list:
    """Four raw peers, each sending 128 MiB of one message in 64 KiB frames at about 100 MiB/s, never finishing."""
    peers = [RawPeer(port, "0", password).connect() for _ in range(4)]
    chunk = frame(bytes(64 * 1024), more=True)

    def trickle(p: RawPeer) -> None:
        try:
            p.send(frame(FETCH, more=True))
            for k in range(128 * 16):
                p.send(chunk)
                if k % 16 == 15:
                    time.sleep(0.01)
        except OSError:
            pass

    threads = [threading.Thread(target=trickle, args=(p,)) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(1.0)
    return peers


def empty_frames(port: int, password: str) -> list:
    """One raw peer sending 64 MiB of one message in empty frames (2 bytes each on the wire), never finishing."""
    peer = RawPeer(port, "0", password).connect()
    chunk = frame(b"", more=True) * (512 * 1024)
    try:
        peer.send(frame(FETCH, more=True))
        for _ in range(64):
            peer.send(chunk)
    except OSError:
        pass
    time.sleep(1.0)
    return [peer]


def unread(port: int, password: str) -> list:
    """200 fetches on one raw connection whose replies are never read."""
    peer = RawPeer(port, "0", password).connect()
    for _ in range(200):
        peer.send(frame(FETCH))
    time.sleep(3.0)
    return [peer]


def attack(name: str) -> tuple[float, float, float]:
    """(RSS before, peak during, held 1.5 s after the attackers closed) of a fresh server, MiB."""
    cfg = from_dict(config("rss", workload={"model": "mlp", "mlp": {"hidden": 1024, "n_layer": 2}},
                           backend=ps(2, "async", auth="plain")))
    services = start_services(cfg, None)
    try:
        address = services.info.addresses[0]
        pid, port = services.workers[0].pid, int(address.rsplit(":", 1)[1])
        creds = Credentials.from_dict(services.info.auth)
        password = (Path(creds.folder) / "worker0.password").read_text().strip()
        time.sleep(1.0)
        before, peak = rss(pid), Peak(pid)
        if name.startswith("multiframe"):
            held = multiframe(address, creds, int(name.split("_")[1]))
        elif name == "slow_senders":
            held = slow_senders(port, password)
        elif name == "empty_frames":
            held = empty_frames(port, password)
        else:
            held = unread(port, password)
        during = peak.stop()
        for h in held:
            if isinstance(h, zmq.Context):
                h.destroy(linger=0)
            elif hasattr(h, "close"):
                h.close()
        time.sleep(1.5)
        return before, during, rss(pid)
    finally:
        services.stop()


def main(names: list[str]) -> None:
    print(f"{'attack':16} {'before':>8} {'peak':>8} {'after':>8}  (server RSS, MiB)")
    for name in names or ["multiframe_256", "multiframe_1024", "slow_senders", "unread", "empty_frames"]:
        before, during, after = attack(name)
        print(f"{name:16} {before:8.0f} {during:8.0f} {after:8.0f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
