"""The backends psarch knows: `backend.kind` -> its BackendSpec (psarch/backend.py).

The built-in backends are one line each in BUILTIN; a backend defined elsewhere registers itself with
`register(spec)` when its module is imported, or through the `psarch.backends` entry-point group of an
installed package. A config's [backend] section may then name its kind and its options (its spec's `options`
class, psarch/config/backend.py). Ranks spawned by the launcher register the same spec classes
(`plugins`) first, so a backend registered in the launcher's process exists in every rank.
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from psarch.backend import BackendSpec

BUILTIN = (
    "psarch.single_spec:SPEC",
    "collective.spec:DDP",
    "zero.spec:ZERO",
    "psarch.ps.spec:PS",
    "collective.pipeline.spec:PIPELINE",
    "collective.tensor.spec:TENSOR",
    "psarch.dp.spec:DP",
    # PyTorch's own implementations, run by the same runner: the peers for parity and benchmarks
    "collective.spec:TORCH_DDP",
    "zero.spec:TORCH_ZERO",
    "zero.spec:TORCH_FSDP",
    "collective.pipeline.spec:TORCH_PIPELINE",
    "collective.tensor.spec:TORCH_TENSOR",
    "psarch.dp.spec:TORCH_DP",
)
ENTRY_POINTS = "psarch.backends"
_BUILTIN_MODULES = {path.partition(":")[0] for path in BUILTIN}

_specs: dict[str, BackendSpec] = {}
_plugins: list[str] = []     # "module:Class" of the specs registered from outside BUILTIN, in registration order
_loaded = False


def builtin_modules() -> list[str]:
    """The modules of the built-in backends' specs (what a launcher's forkserver imports ahead: launch.processes)."""
    return sorted(_BUILTIN_MODULES)


def _object(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for path in BUILTIN:
        _add(_object(path))
    for ep in entry_points(group=ENTRY_POINTS):
        register(ep.load())


def _add(spec: BackendSpec) -> None:
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"{spec!r}: a backend registers a psarch.backend.BackendSpec instance")
    known = _specs.get(spec.kind)
    if known is not None and type(known) is not type(spec):
        raise ValueError(f"backend.kind = {spec.kind!r} is registered twice: by {type(known).__module__} "
                         f"and by {type(spec).__module__}")
    _specs[spec.kind] = spec


def _path(spec: BackendSpec) -> str:
    return f"{type(spec).__module__}:{type(spec).__qualname__}"


def register(spec: BackendSpec) -> BackendSpec:
    """Add a backend (idempotent for the same spec class)."""
    _load()
    _add(spec)
    if type(spec).__module__ not in _BUILTIN_MODULES and _path(spec) not in _plugins:
        _plugins.append(_path(spec))
    return spec


def unregister(kind: str) -> None:
    """Remove a backend registered with register() (tests)."""
    spec = _specs.pop(kind)
    if _path(spec) in _plugins:
        _plugins.remove(_path(spec))


def specs() -> list[BackendSpec]:
    """Every registered backend, built-ins first."""
    _load()
    return list(_specs.values())


def kinds() -> tuple[str, ...]:
    return tuple(s.kind for s in specs())


def spec(kind: str) -> BackendSpec:
    """The spec of `backend.kind = kind`."""
    _load()
    if kind not in _specs:
        raise ValueError(f"backend.kind = {kind!r}: allowed values are {', '.join(_specs)}")
    return _specs[kind]


def spec_of(cfg: Any) -> BackendSpec:
    """The spec of a config's backend."""
    return spec(cfg.backend.kind)


def plugins() -> list[str]:
    """The spec classes ("module:Class") registered from outside BUILTIN: a spawned rank registers them too
    (import_plugins) before it reads its config."""
    _load()
    return list(_plugins)


def import_plugins(paths: list[str]) -> None:
    """Register an instance of each spec class named (those of plugins() in another process)."""
    for path in paths:
        cls = _object(path)
        if cls.kind not in _specs:
            register(cls())

