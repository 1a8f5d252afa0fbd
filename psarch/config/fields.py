"""How a config option is declared: its default, doc, allowed values and bounds, and whether only the
backends that say so read it. psarch.config reads this metadata to check values (`_coerce`), answer
`psarch keys`, and check `applies`. A backend declares its own options with `option` too (psarch/backend.py)."""
from __future__ import annotations

from dataclasses import field
from typing import Any, Callable, Mapping


def option(default: Any, doc: str, choices: tuple | Callable[[], tuple] | None = None, min: float | None = None,
           max: float | None = None, per_backend: bool = False, recorded: bool = False,
           named: tuple[str, ...] = ()) -> Any:
    """A config option, declared as a dataclass field. `choices`: the allowed values (or a function giving them,
    read when a value is checked). `per_backend`: only the backends whose spec reads it (BackendSpec.reads) take
    this option; options a backend declares itself (BackendSpec.options) are always per-backend. `recorded`: written
    by psarch into config.json, never set by a user (not listed by `psarch keys`, refused in a file or --set).
    `named`: words allowed besides values of the field's type, e.g. "auto" for a number (the field is declared
    `float | str`)."""
    meta = {"doc": doc, "choices": choices, "min": min, "max": max, "per_backend": per_backend,
            "recorded": recorded, "named": named}
    if isinstance(default, (list, dict)):
        mutable: list | dict = default     # each instance gets its own copy
        return field(default_factory=lambda: type(mutable)(mutable), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type | Callable[[], type], doc: str | None = None) -> Any:
    """A section: a table of options, the fields of `cls` (or of the class a function gives, built when first
    needed: the [backend] section holds every registered backend's options)."""
    if isinstance(cls, type):
        return field(default_factory=cls, metadata={"doc": doc or cls.__doc__, "section": lambda: cls})
    return field(default_factory=lambda: cls()(), metadata={"doc": doc, "section": cls})


def choices_of(meta: Mapping[str, Any]) -> tuple | None:
    c = meta.get("choices")
    return c() if callable(c) else c
