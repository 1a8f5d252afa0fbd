"""What one TCP connection of a server holds in flight, counted as ZeroMQ holds it (psarch/ps/server/connections.py
keeps the count per connection): a frame's ZMTP framing, what ZeroMQ keeps of a received frame, the kernel's
counters of a connection, the default budget of one connection each way, and a connection's end."""
from __future__ import annotations

import socket
import struct

import zmq

FRAME_COST = 64       # bytes ZeroMQ keeps for one received frame however short (a zmq_msg_t)
CURVE_BOX = 33        # bytes CURVE adds to each frame: the MESSAGE command's name, nonce, MAC and flags
HANDSHAKE = 4 * 1024  # bytes of a ZMTP handshake, at most (greeting 64; CURVE's HELLO/INITIATE < 1 kB)
HEARTBEAT = 64        # bytes of one PING or PONG, at most (CURVE-boxed)
SLACK = 2**18         # bytes of the default budget beyond two exchanges
PER_PARTITION = 1024  # bytes each way of one partition's messages beyond its elements: a push (or pushpull) in,
                      # its ack and its pull's reply out, each a header of ~130 bytes and its frames' ZMTP framing
ZMQ_ZERO_COPY_RECV = 10   # a context option of libzmq's (zmq.h lists it as a draft; pyzmq names it not)


def copy_received_frames(zctx: zmq.Context) -> bool:
    """Make the sockets of `zctx` copy each received frame out of the buffer it was read into. By default
    libzmq keeps a frame of more than 33 bytes as a reference into its 8 KiB read buffer, so a peer sending one
    short frame per TCP segment pins a whole buffer a frame. False where this libzmq refuses the option (then
    that is the bound: 8 KiB a frame)."""
    try:
        zctx.set(ZMQ_ZERO_COPY_RECV, 0)
    except zmq.ZMQError:
        return False
    return True


def framing(size: int, curve: bool) -> int:
    """Bytes of ZMTP around one frame of `size` bytes on the wire (RFC 23: a 2-byte header up to 255 bytes, else
    9; CurveZMQ boxes each frame in a MESSAGE command first)."""
    body = size + (CURVE_BOX if curve else 0)
    return body - size + (2 if body < 256 else 9)


def exchange_budget(elements: int, partitions: int, row_bytes: int, max_header: int) -> int:
    """The default bound on what one connection may have in flight each way (backend.inflight_mb = 0): twice
    the largest exchange of a worker with a server, so that two may be unread at once, + SLACK. An exchange:
    the server's range in fp32 (`elements`) sent as `partitions` messages back to back, each with its own
    header and framing (PER_PARTITION), every row the server owns with its key, and two headers of slack."""
    exchange = 4 * elements + partitions * PER_PARTITION + 2 * max_header + row_bytes
    return 2 * exchange + SLACK


def tcp_counters(fd: int) -> tuple[int, int] | None:
    """(bytes received, bytes sent and acknowledged) of TCP socket `fd` (Linux's TCP_INFO); None if it is gone."""
    # ZeroMQ's own descriptor, borrowed and handed back (detach), not duplicated and closed: the watchdog reads
    # every connection's counters each PERIOD_S, and fromfd's dup and close would double the syscalls
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0, fd)
    except OSError:
        return None
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    finally:
        s.detach()
    if len(info) < 136:
        return None
    acked, received = struct.unpack_from("QQ", info, 120)   # tcpi_bytes_acked, tcpi_bytes_received
    return received, acked


def shut(fd: int) -> None:
    """End TCP connection `fd` at once (a reset: its buffers are freed now); ZeroMQ then closes its side."""
    try:
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
