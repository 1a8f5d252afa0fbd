"""What a PS config implies for its workers' messages, read by the spec, the theory, the workers and the servers
alike (a module of its own: the servers' state must not import the spec, which starts services)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psarch.config import Config


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
