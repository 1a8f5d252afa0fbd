"""How a config option is declared: its default, doc, allowed values, bounds, and which backends read it.
psarch.config reads this metadata to check values (`_coerce`), answer `psarch keys`, and check `applies`."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def _f(default: Any, doc: str, choices: tuple | None = None, min: float | None = None,
       max: float | None = None, applies: dict[str, tuple | None] | None = None) -> Any:
    """A config field. `applies` says which backends read it: {kind: None (every variant) or the variants
    (VARIANT_KEY) that do}; None means every backend."""
    meta = {"doc": doc, "choices": choices, "min": min, "max": max, "applies": applies}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _sub(cls: type) -> Any:
    return field(default_factory=cls, metadata={"doc": cls.__doc__})
