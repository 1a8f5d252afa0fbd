"""The config's vocabulary: where an option is declared (`field_of`), the type its values are checked as, what it
accepts in words, and every option with its default and doc (`psarch keys`)."""
from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from psarch.config.backend import CoreBackendConfig, backend_fields
from psarch.config.fields import choices_of
# field_type evaluates the postponed annotations of every section's fields by these names
from psarch.config.faults import FaultsConfig  # noqa: F401
from psarch.config.schema import ClusterConfig, Config, TrainConfig  # noqa: F401
from psarch.config.workload import (ClicksConfig, DLRMConfig, GPTConfig, MarkovConfig, MLPConfig,  # noqa: F401
                                    TextConfig, WorkloadConfig)
from psarch.errors import ConfigError


def field_type(f: dataclasses.Field) -> type:
    """The type a field's values are checked as (a field with named values, `T | str`: T)."""
    tp = f.type if not isinstance(f.type, str) else eval(f.type, globals())  # annotations are postponed
    return next(t for t in typing.get_args(tp) if t is not str) if f.metadata.get("named") else tp


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    """A section's options by name; [backend]'s: every registered backend's."""
    return backend_fields() if cls is CoreBackendConfig else {f.name: f for f in dataclasses.fields(cls)}


def field_of(key: str) -> dataclasses.Field:
    """The declaration of dotted option `key` (e.g. "backend.k_steps")."""
    cls, parts = Config, key.split(".")
    for i, part in enumerate(parts):
        f = _fields(cls).get(part)
        if f is None or (i + 1 < len(parts)) != ("section" in f.metadata):
            raise ConfigError(f"{key}: unknown key")
        if i + 1 < len(parts):
            cls = f.metadata["section"]()
    assert f is not None    # checked in the loop, which runs at least once (split gives one part or more)
    return f


def allowed_values(key: str) -> str:
    """What option `key` accepts, in words: its choices, or its type and bounds (for `psarch keys`)."""
    f = field_of(key)
    m, choices = f.metadata, choices_of(f.metadata)
    if choices:
        return " | ".join(json.dumps(c) for c in choices)
    name = {int: "integer", float: "number", str: "string", bool: "true | false", list: "list"}[field_type(f)]
    lo, hi = m.get("min"), m.get("max")
    words = "".join(f" | {json.dumps(n)}" for n in m.get("named") or ())
    return (f"{name} in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else
            f"{name} >= {lo:g}" if lo is not None else f"{name} <= {hi:g}" if hi is not None else name) + words


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every field: the config vocabulary, for docs and `psarch keys`."""
    rows = []
    for f in _fields(cls).values():
        if "section" in f.metadata:
            rows += describe(f.metadata["section"](), f"{prefix}{f.name}.")
        elif not f.metadata.get("recorded"):
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                assert f.default_factory is not dataclasses.MISSING, f"{f.name}: option() gives every field a default"
                default = f.default_factory()
            rows.append((prefix + f.name, default, f.metadata.get("doc", "")))
    return rows
