"""The errors a run can end with, in a module that imports nothing, so every layer can raise and catch
them without importing the layer that defines the machinery (dependencies point one way)."""
from __future__ import annotations


class RunError(RuntimeError):
    """A rank (or a service such as a parameter server) failed; the message carries its error."""


class NonFiniteError(RunError):
    """A worker's loss or update is inf/nan outside fp16's skipped steps: the run cannot go on."""
