"""The `ps` backend's trainer class (psarch/registry.py): which worker a run's config asks for."""
from __future__ import annotations

from psarch.config import Config
from psarch.dist import DistContext
from psarch.ps.sparse_worker import RowPSTrainer
from psarch.ps.trainer import PSTrainer
from psarch.workload import Workload


class PSWorker(PSTrainer):
    """Builds a PSTrainer, or a RowPSTrainer when backend.embeddings = "rows" (the tables stay on the
    servers, sharded by row); the launcher reads the backend's class members (services, lost workers) here."""

    def __new__(cls, workload: Workload, cfg: Config, ctx: DistContext) -> PSTrainer:  # type: ignore[misc]
        # an instance of another class: Python does not call __init__ again on it
        worker = RowPSTrainer if cfg.backend.embeddings == "rows" else PSTrainer
        return worker(workload, cfg, ctx)
