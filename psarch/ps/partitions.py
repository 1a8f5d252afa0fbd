"""How a flat vector is split over servers and in partitions: arithmetic on element counts alone (no torch), the
one source of truth read by workers, servers, checkpoints and theory (re-exported by psarch/ps/layout.py)."""
from __future__ import annotations

from psarch.config import Config

WIDTH = {"fp32": 4, "bf16": 2, "fp16": 2}   # bytes per element of each compute dtype on the wire


def server_ranges(numel: int, servers: int) -> list[tuple[int, int]]:
    """Contiguous, balanced [lo, hi) ranges of a flat vector of `numel` elements, one per server
    (sizes differ by at most one element)."""
    if servers < 1:
        raise ValueError(f"backend.servers = {servers}: must be >= 1")
    if numel < servers:
        raise ValueError(f"backend.servers = {servers}: the model has only {numel} parameters, "
                         f"fewer than one per server")
    return [(i * numel // servers, (i + 1) * numel // servers) for i in range(servers)]


PARTITION_ALIGN = 64   # elements: partitions start where a vectorised optimizer kernel's own chunks would


# backend.partition_mb = "auto" (the default): partitions as small as pipelining needs and no smaller than the
# host's own cost of a message allows
PARTITION_MAX_BYTES = 4 * 2**20   # BytePS's partition (4 MB, for 25-100 Gbit/s links): where the link is not known
PIPELINE_DEPTH = 16               # per range: filling the pipeline costs 1/16 of the exchange (README: partition size)
PARTITION_LINK_S = 0.6e-3         # at least this long on the link: 4x a partition's host cost (`psarch bench ps`)


def partition_bytes(cfg: Config, numel: int) -> float:
    """Bytes of each partition of a server's range, for a flat vector of `numel` elements: backend.partition_mb
    MiB, or "auto": the widest range / PIPELINE_DEPTH, but at least PARTITION_LINK_S of the emulated cluster's
    link and at most PARTITION_MAX_BYTES (all of it, where the link's speed is not known: loopback, real
    networks); 0: one partition per server."""
    mb = cfg.backend.partition_mb
    if mb != "auto":
        return mb * 2**20
    width = WIDTH[cfg.train.precision]
    widest = -(-numel // cfg.backend.servers) * width
    c = cfg.cluster
    link = c.link_mbps * 1e6 / 8 * PARTITION_LINK_S if c.emulate and c.link_mbps else PARTITION_MAX_BYTES
    return min(PARTITION_MAX_BYTES, max(widest / PIPELINE_DEPTH, link))


def partition_elems(cfg: Config, numel: int) -> int:
    """Elements in each partition of a server's range of a flat vector of `numel` elements (partition_bytes, of
    the wire dtype), rounded down to a multiple of PARTITION_ALIGN (at least one such block), and never more than
    the widest range rounded up to one (a range is one partition; dealt round robin, a range's worth); 0 when
    partition_mb = 0 (one per server)."""
    size = partition_bytes(cfg, numel)
    if not size:
        return 0
    width = WIDTH[cfg.train.precision]
    widest = -(-numel // cfg.backend.servers)
    whole = -(-widest // PARTITION_ALIGN) * PARTITION_ALIGN
    return min(whole, max(PARTITION_ALIGN, int(size / width) // PARTITION_ALIGN * PARTITION_ALIGN))


def partitions(lo: int, hi: int, elems: int) -> list[tuple[int, int]]:
    """Range [lo, hi) split into partitions of `elems` elements from lo on, the last one shorter (elems = 0:
    the whole range). Boundaries at multiples of PARTITION_ALIGN from lo keep an element-wise optimizer's
    vectorised and scalar paths where they are for the whole range, so a partitioned update is bit-identical."""
    if not elems or hi - lo <= elems:
        return [(lo, hi)]
    return [(a, min(a + elems, hi)) for a in range(lo, hi, elems)]


def server_partitions(cfg: Config, numel: int) -> list[list[tuple[int, int]]]:
    """Each server's partitions of a flat vector of `numel` elements, in flat order: the one source of truth for
    which server holds what, read by servers, workers, checkpoints and theory. backend.partition_assignment
    "round_robin" (the default, BytePS's): the whole vector in partitions of partition_elems from 0, partition j
    on server j mod k, so that every server has partitions in every part of the model (backward readies each
    server's share all through backward, not in 1/k of it); "ranges", or partitions no smaller than a range
    (partition_mb = 0; "auto" on a small model): server i's contiguous range (server_ranges) in partitions. A
    server's own vector (what `init`, `fetch` and its final report carry) is its partitions, joined in this
    order (`gather`, `scatter`)."""
    b = cfg.backend
    elems = partition_elems(cfg, numel)
    if b.partition_assignment == "ranges" or not elems or elems >= -(-numel // b.servers):   # a range each
        return [partitions(lo, hi, elems) for lo, hi in server_ranges(numel, b.servers)]
    every = partitions(0, numel, elems)   # at least k of them: numel > k (range - 1) >= k x elems
    return [every[i::b.servers] for i in range(b.servers)]


def held(parts: list[tuple[int, int]]) -> int:
    """Elements a server with these partitions holds."""
    return sum(b - a for a, b in parts)


def one_range(parts: list[tuple[int, int]]) -> bool:
    """Whether these partitions (in flat order) make one contiguous range."""
    return parts[-1][1] - parts[0][0] == held(parts)


def chain(servers: int, replicas: int, i: int) -> list[int]:
    """The servers that hold server i's partitions with backend.replicas = r (Li et al., OSDI '14: each server's
    key range on the next r servers of a ring): i first, then i + 1, ..., i + r (mod k)."""
    return [(i + j) % servers for j in range(replicas + 1)]


def held_partitions(cfg: Config, numel: int) -> list[list[tuple[int, int]]]:
    """Each server's partitions with their replicas: its own (server_partitions) and those of the r servers before
    it in the ring, in flat order. A server's held vector (what `fetch` and its final report carry) is these
    partitions joined; with r = 0 it is its own vector."""
    return held_of(server_partitions(cfg, numel), replicas(cfg))


def held_of(own: list[list[tuple[int, int]]], r: int) -> list[list[tuple[int, int]]]:
    """Each server's partitions, in flat order, when server i owns `own[i]` and r servers keep a replica of each."""
    k = len(own)
    return [sorted(p for j in range(k) if i in chain(k, r, j) for p in own[j]) for i in range(k)]


def replicas(cfg: Config) -> int:
    """backend.replicas, 0 for backends whose servers keep no replica (the hybrid's tables)."""
    return getattr(cfg.backend, "replicas", 0)
