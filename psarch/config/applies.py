"""Which options a run reads. Every backend reads the core's options but those marked per-backend; a backend's own
options (its spec's `options` class) and the per-backend ones apply where its spec says it reads them
(BackendSpec.reads). One place for the launcher's check, the sweep's de-duplication and `psarch keys`."""
from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from psarch import registry
from psarch.config.backend import CoreBackendConfig
from psarch.config.files import Table, value_at
from psarch.config.keys import field_of
from psarch.config.schema import Config
from psarch.errors import ConfigError, show

if TYPE_CHECKING:
    from psarch.backend import BackendSpec

_CORE_BACKEND = {f"backend.{f.name}" for f in dataclasses.fields(CoreBackendConfig)}


def per_backend(key: str) -> bool:
    """Whether only some backends read option `key`: a backend's own option, or one the core marks so."""
    f = field_of(key)
    return f.metadata.get("per_backend", False) or (key.startswith("backend.") and key not in _CORE_BACKEND)


def option_keys(spec: BackendSpec) -> dict[str, tuple | None]:
    """Every option backend `spec` reads beyond those every backend reads: its class's own (beyond the core's),
    then `reads` (the core's per-backend options it reads; its own that only some variants read)."""
    own = {f"backend.{f.name}": None for f in dataclasses.fields(spec.options or CoreBackendConfig)}
    return {**{k: v for k, v in own.items() if k not in _CORE_BACKEND}, **spec.reads}


def applies(key: str, cfg: Config) -> bool:
    """Whether the backend cfg chooses reads option `key` (dotted, e.g. "backend.k_steps")."""
    if not per_backend(key):
        return True
    spec = registry.spec_of(cfg)
    keys = option_keys(spec)
    if key not in keys:
        return False
    variants = keys[key]
    if variants is None:
        return True
    assert spec.variant_key, f"{spec.kind}: reads lists variants of {key} but no variant_key"
    return getattr(cfg.backend, spec.variant_key) in variants


def applies_to(key: str) -> str:
    """Where option `key` applies, in words, e.g. 'backend.kind = "ps" with backend.mode = "geo"'."""
    if not per_backend(key):
        return "every backend"
    readers = [(s, option_keys(s)[key]) for s in registry.specs() if key in option_keys(s)]
    plain = [json.dumps(s.kind) for s, variants in readers if variants is None]
    parts = [f"backend.kind = {', '.join(plain)}"] if plain else []
    parts += [f"backend.kind = {json.dumps(s.kind)} with backend.{s.variant_key} = "
              f"{', '.join(json.dumps(v) for v in variants)}" for s, variants in readers if variants is not None]
    return " or ".join(parts) or "no registered backend"


FACTORY_REPLACES = ("workload.model", "workload.data")   # a factory is given the Config: it may read the rest


def why_unread(key: str, cfg: Config) -> str:
    if cfg.workload.factory and key in FACTORY_REPLACES:
        return f"workload.factory = {show(cfg.workload.factory)} replaces the built-in model and data"
    spec = registry.spec_of(cfg)
    this = f"backend.kind = {json.dumps(spec.kind)}" + (
        f", backend.{spec.variant_key} = {show(getattr(cfg.backend, spec.variant_key))}" if spec.variant_key else "")
    return f"applies only to {applies_to(key)}; this run has {this}"


def check_applies(cfg: Config, keys: list[str], data: Table) -> None:
    """A ConfigError for the first of `keys` (set in `data`, the raw config) that the chosen backend does not read."""
    for key in keys:
        if not applies(key, cfg):
            raise ConfigError(f"{key} = {show(value_at(data, key))}: {why_unread(key, cfg)} "
                              f"(remove the option or choose a backend that reads it)")


