"""What a PS config implies for its workers' messages, read by the spec, the theory, the workers and the servers
alike (a module of its own: the servers' state must not import the spec, which starts services)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    from psarch.config import Config

# a request's id: its client's session (drawn at random per server) from this bit up, then its number in the session
# (psarch/ps/worker/resend.py, psarch/ps/server/repeats.py)
SESSION_BITS = 32
# an id as a worker sends it and its reply names it: 9 bytes packed, whatever its session and number
RID = 1 << SESSION_BITS
RID_BYTES = len(msgpack.packb({"rid": RID})) - 1   # what the id adds to a header (the map's own byte left out): 13


def pushes_from_hooks(cfg: Config) -> bool:
    """Whether workers push each partition from backward's hooks (backend.overlap_comm): in sync, async and ssp,
    dense, out of fp16 (whose push carries a verdict on the whole gradient, known only after backward) and without
    embedding rows (their push goes first on each connection, and their gradients are final last)."""
    b = cfg.backend
    return (b.overlap_comm and b.mode in ("sync", "async", "ssp") and cfg.train.precision != "fp16"
            and b.embeddings == "dense")


def pulls_deltas(cfg: Config) -> bool:
    """Whether pulls carry each partition's compressed change since what the worker holds (server/deltas.py), not
    the partition whole: GEO with train.compression (the other modes pull parameters whole)."""
    return cfg.backend.mode == "geo" and cfg.train.compression != "none"


def commit_header(step: int, offset: int, members: str | None = None) -> dict[str, Any]:
    """A `commit` as a worker sends it (worker/link.py; chain replication, psarch/ps/replication.py): the round
    `step` of the partition at `offset` sums the workers `members` names (replication.members_text); without
    members, the holders before the one it goes to are dead."""
    header: dict[str, Any] = {"op": "commit", "step": step, "offset": offset}
    if members is not None:
        header["members"] = members
    return header


def commit_bytes(workers: int, step: int, offset: int, worker: int) -> int:
    """Bytes of worker `worker`'s commit of round `step` of the partition at `offset` on the wire (its one frame, the
    header as wire.encode packs it), where the round summed all of `workers` workers."""
    members = format((1 << workers) - 1, "x")
    return len(msgpack.packb(dict(commit_header(step, offset, members), worker=worker, rid=RID), use_bin_type=True))


def ack_bytes(version: int) -> int:
    """Bytes of the `ack` a server answers a commit with (its version after it, the commit's id) on the wire."""
    return len(msgpack.packb({"op": "ack", "version": version, "rid": RID}, use_bin_type=True))
