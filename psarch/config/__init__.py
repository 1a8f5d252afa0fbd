"""Experiment configuration: typed dataclasses loaded from TOML, with `base` inheritance and overrides.

Precedence: dataclass defaults < TOML file (after its `base` chain) < `--set section.key=value`.
Every mistake stops the run before any process starts, with one line naming key, value and what is allowed.
The [backend] section is one flat table in TOML; its class is the chosen backend's own (config/backend.py).

This package: loading (here: values checked, sections built, `load_config`), `schema.py` (the Config classes),
`fields.py` (`option` and `section`: how an option is declared, by the core and by every backend's spec),
`backend.py` (the core's [backend] options and the groups several backends include), `workload.py` (the
[workload] sections), `faults.py` (the [faults] section), `files.py` (TOML, `base`, `--set`), `keys.py` (where an option is declared, what it
accepts, `psarch keys`), `applies.py` (which options a run reads) and `rules.py` (the checks across keys,
made before any process starts).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

# the package's interface: the schema, the vocabulary, which options apply, raw data, the machine checks, and
# ConfigError (declared in psarch.errors, which imports nothing, so that the cluster's device profiles and the
# machine checks this package runs can raise it without importing this package)
from psarch.config.applies import (FACTORY_REPLACES, applies, applies_to, check_applies, option_keys,  # noqa: F401
                                   per_backend, why_unread)
from psarch.config.backend import CoreBackendConfig, backend_class, backend_fields
from psarch.config.fields import choices_of
from psarch.config.files import (Table, apply_overrides, drop, explicit_keys, parse_override,  # noqa: F401
                                 read_toml, top_table, value_at)
from psarch.config.keys import allowed_values, describe, field_of, field_type  # noqa: F401
from psarch.config.schema import REPORT_ONLY, ClusterConfig, Config, TrainConfig  # noqa: F401
from psarch.config.workload import (ClicksConfig, DLRMConfig, GPTConfig, MarkovConfig, MLPConfig,  # noqa: F401
                                    TextConfig, WorkloadConfig)
from psarch.errors import ConfigError, show
from psarch.machine import check_machine, resolve_factory  # noqa: F401


# ---------------------------------------------------------------- loading

def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}.get(tp, str(tp))


def _named(f: dataclasses.Field) -> str:
    """' or "auto"': the words a field takes besides its type's values ('' where none)."""
    return "".join(f" or {json.dumps(n)}" for n in f.metadata.get("named") or ())


def _coerce(key: str, value: Any, f: dataclasses.Field) -> Any:
    if isinstance(value, str) and value in (f.metadata.get("named") or ()):
        return value
    tp = field_type(f)
    ok = (isinstance(value, bool) if tp is bool else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
          isinstance(value, tp))
    if not ok:
        raise ConfigError(f"{key} = {show(value)}: expected {_type_name(tp)}{_named(f)}")
    if tp is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key} = {show(value)}: expected a finite number")
    choices, lo, hi = choices_of(f.metadata), f.metadata.get("min"), f.metadata.get("max")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} = {show(value)}: allowed values are {', '.join(json.dumps(c) for c in choices)}")
    if lo is not None and value < lo:
        raise ConfigError(f"{key} = {show(value)}: must be >= {lo:g}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} = {show(value)}: must be <= {hi:g}")
    return value


def _unknown(key: str, value: Any, prefix: str, allowed: Any) -> ConfigError:
    where = f" in [{prefix[:-1]}]" if prefix else ""
    return ConfigError(f"{key} = {show(value)}: unknown key; allowed keys{where} are {', '.join(sorted(allowed))}")


def _build(cls: type, data: Table, prefix: str, others: bool = False) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in fields:
            raise _unknown(key, v, prefix, fields)
        f = fields[k]
        if "section" in f.metadata:
            if not isinstance(v, dict):
                raise ConfigError(f"{key} = {show(v)}: expected a table [{key}]")
            section_cls = f.metadata["section"]()
            kwargs[k] = (_build_backend(v, key + ".", others) if section_cls is CoreBackendConfig else
                         _build(section_cls, v, key + ".", others))
        else:
            kwargs[k] = _coerce(key, v, f)
    return cls(**kwargs)


def _build_backend(data: Table, prefix: str, others: bool) -> Any:
    """The [backend] section as the chosen backend's own class. An option of another backend is checked like any
    value, then refused, or left out where `others` (a base file's shared defaults, a recorded config)."""
    allowed = backend_fields()
    kind = _coerce(f"{prefix}kind", data["kind"], allowed["kind"]) if "kind" in data else CoreBackendConfig.kind
    cls = backend_class(kind)
    own = {f.name for f in dataclasses.fields(cls)}
    for k, v in data.items():
        if k not in allowed:
            raise _unknown(f"{prefix}{k}", v, prefix, allowed)
        _coerce(f"{prefix}{k}", v, allowed[k])
        if k not in own and not others:
            raise ConfigError(f"{prefix}{k} = {show(v)}: applies only to {applies_to(prefix + k)}; this run has "
                              f"backend.kind = {json.dumps(kind)} (remove the option or choose a backend that reads it)")
    return _build(cls, {k: v for k, v in data.items() if k in own}, prefix)


def from_dict(data: Table, name: str = "", others: bool = False) -> Config:
    """Build and validate a Config from raw (already merged) data. [backend] options of a backend other than the
    chosen one are refused, or, with `others`, left out."""
    from psarch.config.rules import validate

    cfg = _build(Config, data, "", others)
    if not cfg.name:
        cfg.name = name or "run"
    return validate(cfg)


def from_record(data: Table) -> Config:
    """A config as a run folder recorded it (config.json). Older records list every backend's options, each at its
    default: those of other backends are left out."""
    return from_dict(data, others=True)


def load_config(path: str | Path | None = None, overrides: list[str] | Table | None = None,
                notes: list[str] | None = None) -> Config:
    """Load a TOML experiment (following `base`), apply overrides, validate. Raises ConfigError.

    Every option set by an override must apply to the chosen backend, and so must every option the file sets
    itself, with one exception: an option the file alone would have read, which an override made inapplicable
    (`--set backend.kind=ps` on a ddp file that sets backend.comm). Such an option is dropped, as are
    workload.model and workload.data wherever a workload.factory replaces them; each drop appends a line to
    `notes`. Options from a `base` file are shared defaults (one base may serve every backend) and are not
    checked; nor are the options of a file with a [sweep] table, which the sweep checks against its points."""
    top = top_table(Path(path)) if path is not None else {}
    data = read_toml(Path(path)) if path is not None else {}
    merged = apply_overrides(data, overrides) if overrides else data
    _refuse_recorded(merged)
    stem = Path(path).stem if path is not None else "run"
    cfg = from_dict(merged, stem, others=True)   # other backends' options: checked below, key by key
    if "sweep" in top:
        return cfg
    set_keys = explicit_keys({}, overrides)
    replaced = [k for k in explicit_keys(top, overrides) if k in FACTORY_REPLACES and cfg.workload.factory]
    check_applies(cfg, [k for k in set_keys if k not in replaced], merged)
    unread = [k for k in explicit_keys(top) if k not in set_keys + replaced and not applies(k, cfg)]
    alone = _file_alone(data, stem) if unread and overrides else None
    check_applies(cfg, [k for k in unread if alone is None or not applies(k, alone)], merged)   # the file's own mistake
    if not unread + replaced:
        return cfg
    by_reason: dict[str, list[str]] = {}
    for key in replaced + unread:
        # a key not set by --set came from the file, so there is one
        where = "--set" if key in set_keys or path is None else f"set in {Path(path).name}"
        by_reason.setdefault(why_unread(key, cfg), []).append(f"{key} = {show(value_at(merged, key))} ({where})")
        drop(merged, key)
    for why, keys in by_reason.items():
        if notes is not None:
            notes.append(f"{', '.join(keys)} {'is' if len(keys) == 1 else 'are'} not read by this run: {why}; dropped")
    return from_dict(merged, stem, others=True)


def _refuse_recorded(data: Table) -> None:
    for f in dataclasses.fields(Config):
        if f.metadata.get("recorded") and f.name in data:
            raise ConfigError(f"{f.name} = {show(data[f.name])}: psarch records it in config.json; it is not a "
                              f"setting (remove it)")


def _file_alone(data: Table, stem: str) -> Config | None:
    """The config the file makes without overrides, or None where it is not valid by itself."""
    try:
        return from_dict(data, stem, others=True)
    except ConfigError:
        return None



