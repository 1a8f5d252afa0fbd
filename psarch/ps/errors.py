"""The parameter server's errors, apart from the server so that clients need not import it."""
from __future__ import annotations

from psarch.errors import RunError


class PSError(RuntimeError):
    """A request the server refused (the message says why), or a failed server."""


class ServiceError(RunError):
    """A parameter server failed or died; the message says which and why."""
