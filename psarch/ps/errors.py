"""The parameter server's errors, apart from the server so that clients need not import it."""
from __future__ import annotations

from psarch.errors import NonFiniteError, RunError


class PSError(RuntimeError):
    """A request the server refused (the message says why), or a failed server."""


class ServiceError(RunError):
    """A parameter server failed or died; the message says which and why."""


class NonFinitePush(PSError, NonFiniteError):
    """A push whose gradient or delta holds inf/nan: refused, nothing applied; it stops the run."""

    code = "non_finite"   # the error reply's `code`, so the worker raises this type again


class WorkerLost(PSError):
    """A request of a worker the server dropped (a barrier round went on without it, or its process died): refused;
    `version` is the server's then, so that a sync worker that comes back can ask to rejoin (server/readmit.py)."""

    code = "lost"   # the error reply's `code`, so the worker raises this type again

    def __init__(self, message: str, version: int = 0) -> None:
        super().__init__(message)
        self.version = version


class RejoinLate(PSError):
    """A sync worker's `rejoin` at a round its server has passed (server/readmit.py): refused; `version` is the newest
    round any of the server's partitions has reached, so that the worker can ask again at the round after it."""

    code = "late"   # the error reply's `code`, so the worker raises this type again

    def __init__(self, message: str, version: int = 0) -> None:
        super().__init__(message)
        self.version = version
