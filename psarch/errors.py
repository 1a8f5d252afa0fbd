"""The errors a run can end with, in a module that imports nothing of psarch, so every layer can raise and catch
them without importing the layer that defines the machinery (dependencies point one way)."""
from __future__ import annotations

import json
import math
from typing import Any, Callable


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the key, the value and what is allowed."""


def show(value: Any) -> str:
    """A value as the user wrote it, on one line (TOML dates and times included)."""
    return json.dumps(value, default=str)


class RunError(RuntimeError):
    """A rank (or a service such as a parameter server) failed; the message carries its error."""


class NonFiniteError(RunError):
    """A worker's loss or update is inf/nan outside fp16's skipped steps: the run cannot go on."""


class NonFiniteGradient(NonFiniteError):
    """A worker's loss is finite but the gradients it was to apply hold inf/nan (outside fp16's loss scaling):
    the optimizer refused the update. A peer's NaN loss spread by an all-reduce ends here too, so the
    launcher names a NaN loss before it."""


# A rank that stops for a non-finite loss exits with this code, so that the launcher stops the run even
# in modes that go on without a lost worker (a worker that dies may be replaced; a poisoned run may not).
NON_FINITE_EXIT = 65   # sysexits.h EX_DATAERR: the data (here: the numbers) went bad


def check_loss(step: int, worker: int, loss: float, skipped: bool = False) -> None:
    """Raise NonFiniteError naming the step and the worker when `loss` is inf/nan, except on a step that
    fp16's loss scaling skipped by design."""
    if not skipped and not math.isfinite(loss):
        raise NonFiniteError(f"step {step}: worker {worker}'s loss is {loss}: the run stops before the "
                             f"non-finite value reaches the parameters")


def check_gradients(step: int, rank: int, loss: float, refused: bool, suspects: Callable[[], list[str]]) -> None:
    """Raise NonFiniteGradient naming the step, the rank and the `suspects()` (parameters whose gradient is
    inf/nan, where the backend can tell) when the optimizer `refused` a step outside fp16's loss scaling."""
    if refused:
        names = suspects()
        which = f" (of {', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" if names else ""
        raise NonFiniteGradient(f"step {step}: rank {rank}'s gradients{which} hold inf/nan while its loss "
                                f"({loss:.6g}) is finite: the update was refused and the run stops before the "
                                f"non-finite value reaches the parameters")
