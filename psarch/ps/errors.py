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
