"""A ZMTP 3.0 peer over a plain TCP socket, for attacks a ZeroMQ socket cannot make: a multipart message
sent a frame at a time and never finished, replies never read. PLAIN or NULL mechanism (RFC 23, RFC 24)."""
from __future__ import annotations

import socket
import struct
import time


def _greeting(mechanism: bytes) -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00") + b"\x00" + bytes(31)


def command(name: bytes, body: bytes = b"") -> bytes:
    data = bytes([len(name)]) + name + body
    return (b"\x04" + bytes([len(data)]) if len(data) < 256 else b"\x06" + struct.pack(">Q", len(data))) + data


def frame(data: bytes | memoryview, more: bool = False) -> bytes:
    """One message frame: flags (MORE, LONG), size, the bytes."""
    flags = 1 if more else 0
    if len(data) < 256:
        return bytes([flags, len(data)]) + bytes(data)
    return bytes([flags | 2]) + struct.pack(">Q", len(data)) + bytes(data)


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def closed(sock: socket.socket, wait_s: float) -> bool:
    """Whether the other end closed `sock` (EOF or reset) within `wait_s`, whatever it sent first."""
    deadline = time.monotonic() + wait_s
    try:
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            if not sock.recv(1 << 16):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


class RawPeer:
    """A DEALER spoken by hand: `connect` does the handshake (PLAIN with user/password, else NULL)."""

    def __init__(self, port: int, user: str | None = None, password: str | None = None, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # reads nothing it is not asked to
        self.user, self.password = user, password

    def connect(self) -> "RawPeer":
        plain = self.user is not None
        self.sock.sendall(_greeting(b"PLAIN" if plain else b"NULL"))
        self._read(64)
        ready = _property(b"Socket-Type", b"DEALER") + _property(b"Identity", b"")
        if plain:
            u, p = self.user.encode(), self.password.encode()
            self.sock.sendall(command(b"HELLO", bytes([len(u)]) + u + bytes([len(p)]) + p))
            name = self.read_command()
            if name != b"WELCOME":
                raise ConnectionError(f"PLAIN handshake refused: {name!r}")
            self.sock.sendall(command(b"INITIATE", ready))
        else:
            self.sock.sendall(command(b"READY", ready))
        if self.read_command() != b"READY":
            raise ConnectionError("no READY from the server")
        return self

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            out += chunk
        return out

    def read_command(self) -> bytes:
        flags = self._read(1)[0]
        size = struct.unpack(">Q", self._read(8))[0] if flags & 2 else self._read(1)[0]
        body = self._read(size)
        return body[1:1 + body[0]]

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def closed_by_server(self, wait_s: float) -> bool:
        return closed(self.sock, wait_s)

    def close(self) -> None:
        self.sock.close()
