"""RankJob: what a run's launcher hands each of its ranks (spawned, in this process, or under torchrun)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psarch import registry
from psarch.config import Config, from_dict
from psarch.records import ServiceFields


@dataclass
class RankJob:
    """What every rank of a run is given (JSON-able and picklable: it crosses to spawned ranks): the config,
    the run folder, where checkpoints go (None: nowhere), the checkpoint the run starts from (None: step 0)
    and whether that start resumes the run (its step records carried on) or forks it; the spec classes of
    backends registered outside psarch, the services' info (ServiceInfo.to_dict()) and when the launcher launched
this world (time.monotonic(); None under torchrun): its start-up deadline's origin (faults.startup_s)."""

    cfg: dict[str, Any]
    out: str
    echo: bool
    checkpoints: Path | None
    start: Path | None
    resume: bool
    plugins: list[str]
    info: ServiceFields = field(default_factory=lambda: ServiceFields())
    launched: float | None = None

    def config(self) -> Config:
        registry.import_plugins(self.plugins)   # before the config names a backend registered outside psarch
        return from_dict(self.cfg)
