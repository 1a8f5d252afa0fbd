"""Who may talk to a parameter server: ZeroMQ's ZAP (RFC 27) with PLAIN or CURVE, and the socket bounds.

`backend.auth`:
- "curve": CurveZMQ. One key pair per worker and per server (`psarch keygen DIR`: DIR/worker{i}.key and
  .key_secret, DIR/server{j}.key and .key_secret, ZPL text); a server accepts only the listed worker keys.
- "plain": ZeroMQ PLAIN with one random password per worker (DIR/worker{i}.password), for links no one
  else can read (PLAIN sends the password in clear).
- "auto": PLAIN when the servers bind loopback, CURVE when they bind an address other machines reach.
- "none": no handshake check at all; loopback only.
Runs that start their own servers (`psarch run`) make fresh credentials per run in a private temporary
folder (0700, files 0600; removed when the launcher ends, by any signal: psarch/ps/key_watch.py) unless
backend.keys names a folder; standalone servers (`psarch server`) need backend.keys. Credentials travel as
that folder's path (never the secrets themselves, never a command line): each process reads only its own
secret.

The ZAP handler runs in a thread of its own beside the server's loop. It binds each connection
to a worker: ZAP's User-Id is the worker's number, so the server checks that every request names the
worker its connection authenticated as. It also refuses a handshake once the server's connections past theirs
reach backend.max_connections, or the worker's reach backend.max_connections_per_worker (counted by
psarch/ps/server/connections.py): handshakes in progress or refused hold no slot (they have a cap of their own,
backend.max_pending, past which the oldest is dropped), so peers that cannot authenticate never keep a worker
out, and no worker keeps another out.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

import zmq
import zmq.auth

from psarch.ps import wire
from psarch.ps.key_watch import KeyFolder

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"psarch"
KEYGEN_HINT = "run `psarch keygen DIR --workers N --servers S`, copy DIR to every machine and set backend.keys = \"DIR\""


class AuthError(ValueError):
    """A missing or unusable credential, or an auth mode this address does not allow; one line saying why."""


def is_loopback(host: str) -> bool:
    """True when only this machine can reach `host` (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False   # a name or an interface: assume others reach it


def mechanism(auth: str, host: str) -> str:
    """The mechanism `backend.auth` means for servers bound to `host`: "plain", "curve" or "none"."""
    if auth == "auto":
        return "plain" if is_loopback(host) else "curve"
    if auth == "none" and not is_loopback(host):
        raise AuthError(f"backend.auth = \"none\": allowed only on loopback, but servers bind {host!r}; "
                        f"use \"auto\" or \"curve\"")
    return auth


def keygen(folder: str | Path, workers: int, servers: int) -> Path:
    """Write a CURVE key pair and a PLAIN password per worker and a CURVE key pair per server."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in [f"worker{i}" for i in range(workers)] + [f"server{j}" for j in range(servers)]:
        _, secret = zmq.auth.create_certificates(folder, name)
        os.chmod(secret, 0o600)
    for i in range(workers):
        path = folder / f"worker{i}.password"
        path.write_text(secrets.token_hex(16))
        os.chmod(path, 0o600)
    return folder


@dataclass
class Credentials:
    """Where a run's credentials are (JSON-able: it travels to workers in the services info)."""

    mechanism: str          # "plain", "curve" or "none"
    folder: str = ""        # holds the key files ("" for none)

    def to_dict(self) -> dict[str, str]:
        return {"mechanism": self.mechanism, "folder": self.folder}

    @staticmethod
    def from_dict(d: dict[str, str] | None) -> "Credentials":
        return Credentials(**d) if d else Credentials("none")


def run_credentials(cfg: Any, host: str) -> tuple[Credentials, KeyFolder | None]:
    """Credentials for a run that starts its own servers; the second value is a temporary folder to
    remove when the servers stop (None when backend.keys names the folder), removed by its watcher should
    the launcher die first (psarch/ps/key_watch.py)."""
    b = cfg.backend
    mech = mechanism(b.auth, host)
    if mech == "none":
        return Credentials("none"), None
    if b.keys:
        check_folder(b.keys, mech, b.world_size, b.servers)
        return Credentials(mech, str(b.keys)), None
    tmp = KeyFolder()   # mode 0700
    keygen(tmp.path, b.world_size, b.servers)
    return Credentials(mech, tmp.path), tmp


def max_frame(held: int | None) -> int:
    """The largest frame a worker may send: a header, or a payload frame of at most CHUNK bytes of the most
    elements a server holds, in fp32 (init; pushes are no wider). held None (not known yet): a whole CHUNK."""
    widest = wire.CHUNK if held is None else 4 * held
    return min(wire.CHUNK, widest) + wire.MAX_HEADER


def standalone_credentials(cfg: Any, host: str) -> Credentials:
    """A server started on its own (`psarch server`) takes credentials from backend.keys, or refuses."""
    b = cfg.backend
    mech = mechanism(b.auth, host)
    if mech == "none":
        return Credentials("none")
    if not b.keys:
        raise AuthError(f"a server bound to {host} with backend.auth = {b.auth!r} ({mech}) needs keys: "
                        f"{KEYGEN_HINT}" + (" (or backend.auth = \"none\" on loopback)" if is_loopback(host) else ""))
    check_folder(b.keys, mech, b.world_size, b.servers)
    return Credentials(mech, b.keys)


def check_folder(folder: str | Path, mech: str, workers: int, servers: int) -> None:
    """Raise AuthError naming the first credential file that a run of this size needs and lacks."""
    need = ([f"worker{i}.password" for i in range(workers)] if mech == "plain" else
            [f"worker{i}.key" for i in range(workers)] + [f"server{j}.key" for j in range(servers)])
    for name in need:
        if not (Path(folder) / name).is_file():
            raise AuthError(f"backend.keys = {str(folder)!r}: no {name} there; {KEYGEN_HINT}")


def remove(folder: KeyFolder | str | None) -> None:
    """Remove a run's credential folder (and end its watcher)."""
    if isinstance(folder, KeyFolder):
        folder.remove()
    elif folder:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- sockets

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)   # plain ints: `&` with pyzmq's IntFlag builds an enum a call


def readable(sock: zmq.Socket) -> bool:
    """Whether a whole message waits on `sock` (ZMQ_EVENTS: far cheaper than a NOBLOCK recv raising Again)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)


# ZMQ_HEARTBEAT_TTL crosses the wire in deciseconds, in 16 bits (ZMTP 3.1's PING), and the peer's libzmq (4.3.5)
# multiplies it by 100 into the same 16 bits to arm its timer in ms: a TTL past 655 deciseconds wraps there (330 s,
# 30 s x D = 11: 2.32 s), and the peer drops a connection that is merely quiet between two heartbeats, with the
# requests in flight on it (ZeroMQ resends none); its reconnections then reach ZAP's per-worker cap, which refuses
# the worker for good (issue 31's lost replies)
MAX_HEARTBEAT_TTL_MS = 65500


def bound(sock: zmq.Socket, heartbeat_s: float, heartbeat_timeout_s: float,
          handshake_timeout_s: float | None = None) -> None:
    """Heartbeats that drop a stalled peer (one that answers no PING, or stops mid-message), and a handshake
    deadline (None: the heartbeat timeout) that drops a peer that never finishes its handshake."""
    if heartbeat_s > 0:
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout_s * 1000))
        # the peer's own deadline for us, where a PING carries it whole; past that none (0), not a shorter one: the
        # peer's own HEARTBEAT_TIMEOUT (a psarch peer's is this one) keeps the deadline dilation stretched
        ttl = int(heartbeat_timeout_s * 1000)
        sock.setsockopt(zmq.HEARTBEAT_TTL, ttl if ttl <= MAX_HEARTBEAT_TTL_MS else 0)
    handshake = heartbeat_timeout_s if handshake_timeout_s is None else handshake_timeout_s
    sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake * 1000)))


def client_socket(sock: zmq.Socket, creds: Credentials, worker: int, server: int) -> None:
    """Make a worker's DEALER to server `server` authenticate as `worker` (before it connects)."""
    folder = Path(creds.folder)
    if creds.mechanism == "plain":
        sock.setsockopt(zmq.PLAIN_USERNAME, str(worker).encode())
        sock.setsockopt(zmq.PLAIN_PASSWORD, _read(folder / f"worker{worker}.password").encode())
    elif creds.mechanism == "curve":
        public, secret = _certificate(folder / f"worker{worker}.key_secret")
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = _certificate(folder / f"server{server}.key")[0]


def server_socket(sock: zmq.Socket, creds: Credentials, server: int) -> None:
    """Make a server's ROUTER demand the handshake of `creds` (ZAP decides who passes)."""
    sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)   # NULL too goes through ZAP: it still enforces the connection cap
    if creds.mechanism == "plain":
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
    elif creds.mechanism == "curve":
        public, secret = _certificate(Path(creds.folder) / f"server{server}.key_secret")
        sock.curve_server, sock.curve_publickey, sock.curve_secretkey = True, public, secret


def stranger(creds: Credentials, frame: Any, worker: Any) -> str | None:
    """Why a request whose first frame is `frame` may not act as the worker it names (None: it may). Without
    auth ("none", loopback only) every request may."""
    if creds.mechanism == "none":
        return None
    user = frame.get("User-Id") if hasattr(frame, "get") else None
    if not user or str(worker) != user:
        return f"this connection is authenticated as worker {user or '?'}: it may act only as itself"
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as e:
        raise AuthError(f"cannot read credential {path}: {e.strerror}; {KEYGEN_HINT}") from None


def _certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise AuthError(f"cannot read key {path}: {e}; {KEYGEN_HINT}") from None


class ZapHandler:
    """Answers the ZAP requests of one server's context: who a connecting peer is, if anyone."""

    def __init__(self, zctx: zmq.Context, creds: Credentials, workers: int,
                 admit: Callable[[str], str | None]) -> None:
        """admit(user): None if a handshake that proved `user` may take a slot (it then holds one), else why not."""
        self.mechanism, self.admit = creds.mechanism, admit
        folder = Path(creds.folder)
        # bytes on both sides: compare_digest refuses str with non-ASCII characters (a stranger's password)
        self.passwords = ({str(i).encode(): _read(folder / f"worker{i}.password").encode()
                           for i in range(workers)} if creds.mechanism == "plain" else {})
        self.curve_keys = ({zmq.utils.z85.decode(_certificate(folder / f"worker{i}.key")[0]): str(i)
                            for i in range(workers)} if creds.mechanism == "curve" else {})
        self.rep = zctx.socket(zmq.REP)
        self.rep.setsockopt(zmq.LINGER, 0)
        self.rep.bind(ZAP_ENDPOINT)
        self.refused = 0       # handshakes refused (bad credentials, or over the cap)

    def start(self) -> None:
        """Answer ZAP requests from now on, in a thread of its own: a flood of handshakes (each may wait for the
        connection count to catch up, Connections.admit) never holds the server's loop."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="psarch-zap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.rep.poll(50):
                self._handle(self.rep.recv_multipart())

    def _handle(self, req: list[bytes]) -> None:
        """Answer one ZAP request."""
        try:
            self._answer(req)
        except Exception as e:   # a peer's handshake must never end the server: refuse it (REP owes one reply)
            self.refused += 1
            request_id = req[1] if len(req) > 1 else b""
            self.rep.send_multipart([b"1.0", request_id, b"500", f"ZAP error: {type(e).__name__}".encode(),
                                     b"", b""])

    def _answer(self, req: list[bytes]) -> None:
        if len(req) < 6:
            return self.rep.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
        version, request_id, domain, _address, _identity, mech, *creds = req
        user = self._user(domain, mech, creds)
        reason = b"credentials refused"
        if user is not None:
            over = self.admit(user)
            if over is not None:
                user, reason = None, over.encode()
        if user is None:
            self.refused += 1
            self.rep.send_multipart([version, request_id, b"400", reason, b"", b""])
        else:
            self.rep.send_multipart([version, request_id, b"200", b"OK", user.encode(), b""])

    def _user(self, domain: bytes, mech: bytes, creds: list[bytes]) -> str | None:
        """The worker number a handshake proves (a string), "" for NULL, None when refused."""
        if domain != DOMAIN:
            return None
        if mech == b"NULL" and self.mechanism == "none":
            return ""
        if mech == b"PLAIN" and self.mechanism == "plain" and len(creds) == 2:
            user, password = creds
            expected = self.passwords.get(user)
            return user.decode() if expected is not None and secrets.compare_digest(password, expected) else None
        if mech == b"CURVE" and self.mechanism == "curve" and len(creds) == 1:
            return self.curve_keys.get(creds[0])
        return None

    def close(self) -> None:
        """Stop answering (the socket was made in the server's thread and is used only by the ZAP thread)."""
        if hasattr(self, "_thread"):
            self._stop.set()
            self._thread.join(2)
        self.rep.close(0)
