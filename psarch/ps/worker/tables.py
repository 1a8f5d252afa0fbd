"""A PS worker's embedding treatment (psarch.embeddings.EmbeddingTables), held by the worker whatever
`backend.embeddings` says: this class is "dense" (the tables are parameters like the others, part of the flat
vector the servers hold: nothing moves beside it), WorkerRows (rows.py) is "rows" (the tables stay on the
servers). The worker calls every method at its place in the step, and never asks which treatment it holds.

Beside the interface, what a PS worker's rows need: their messages ride on the dense exchange's connections,
ahead of the dense push on each (`before_push`, then `pushed` once that exchange is over), and the worker's
own checkpoint record carries what it holds (`record`, `restore`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from psarch.embeddings import EmbeddingTables

if TYPE_CHECKING:
    from psarch.checkpoint import Checkpoint
    from psarch.ps.snapshot import RowsRecord, WorkerRecord
    from psarch.ps.worker.client import Request


class PSTables(EmbeddingTables):
    """The dense treatment on a PS worker; the base of WorkerRows."""

    def before_push(self, push: int, versions: list[int | None]) -> list["Request"] | None:
        """Per server, the request to send ahead of dense push `push` (the servers' versions in `versions`);
        None: nothing."""
        return None

    def pushed(self) -> None:
        """The exchange `before_push` rode on is over (GEO: the next steps read the servers' new rows)."""

    def record(self) -> RowsRecord:
        """What this worker's checkpoint record keeps of it (beside its fragments)."""
        return {}

    def restore(self, ckpt: "Checkpoint", record: WorkerRecord | None) -> None:
        """Continue from `ckpt`: this worker's own `record` when this run's shape wrote it, else None (a fork)."""
