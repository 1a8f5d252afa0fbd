"""What a server asks of the C library's process-wide state, which ZeroMQ relies on.

- `seed_routing_ids`: a ROUTER names each peer that names none itself 0x00 + a 32-bit counter, started from the
  C library's rand(), which nothing seeds: every process's first ROUTER starts from the same value. A peer may
  name itself (ZMQ_ROUTING_ID) with such an id; when the counter later reaches it, libzmq asserts and the
  process aborts. libzmq cannot stop a peer choosing its id, so the counter must start where no peer can
  guess: srand from os.urandom before the ROUTER is made. (A peer that tries ids blindly needs one whole
  authenticated handshake per guess of 2^32.)
- `release_freed_memory`: freed message frames go back to the system (malloc_trim), not only to glibc's arenas,
  so memory a dropped connection pinned is given back, not kept for good.
"""
from __future__ import annotations

import ctypes
import os
import sys

_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def seed_routing_ids() -> None:
    """Seed rand() (which libzmq draws a ROUTER's first generated routing id from) from os.urandom."""
    if _LIBC is not None:
        _LIBC.srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "little")))


def release_freed_memory() -> None:
    """Return the heap's free pages to the system (glibc; elsewhere nothing)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(ctypes.c_size_t(0))
