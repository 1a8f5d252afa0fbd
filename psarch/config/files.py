"""Raw config data: TOML files with `base` inheritance, `--set` overrides, and which keys a user set
explicitly. The typed configuration built from it lives in psarch.config."""
from __future__ import annotations

import json
import tomllib
import datetime
from pathlib import Path
from typing import Any, Union

from psarch.errors import ConfigError, show

# raw config data as TOML gives it: a table of values, each a scalar, a list of values or a table
TomlValue = Union[str, int, float, bool, datetime.date, datetime.time, datetime.datetime, list["TomlValue"],
                  dict[str, "TomlValue"]]
Table = dict[str, TomlValue]


def merge(base: Table, top: Table) -> Table:
    """top's keys over base's, tables merged key by key; a new dict all the way down (inputs untouched)."""
    out = {k: merge(v, {}) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in top.items():
        below = out.get(k)
        out[k] = merge(below if isinstance(below, dict) else {}, v) if isinstance(v, dict) else v
    return out


def read_toml(path: Path, seen: tuple[Path, ...] = ()) -> Table:
    """A config file's data merged over its `base` chain's, without any [sweep] table."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"base = {json.dumps(str(path))}: inheritance cycle ({' -> '.join(p.name for p in seen + (path,))})")
    if not path.is_file():
        raise ConfigError(f"config file {json.dumps(str(path))}: no such file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {json.dumps(str(path))}: not UTF-8 text (byte {e.start}); "
                          f"TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {json.dumps(str(path))}: not valid TOML ({e})") from None
    base = data.pop("base", None)
    data.pop("sweep", None)  # a sweep matrix is expanded by the sweep runner, not here
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"base = {show(base)}: expected a path string")
    if not (path.parent / base).is_file():
        raise ConfigError(f"base = {show(base)} in {show(str(path))}: no such file {show(str(path.parent / base))} "
                          f"(a base is found relative to the file that names it)")
    return merge(read_toml(path.parent / base, seen + (path,)), data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (['section', 'key'], value); the value is read as TOML, else as a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def apply_overrides(data: Table, overrides: list[str] | Table) -> Table:
    """Apply `section.key=value` strings (or a {dotted key: value} dict) on top of raw config data."""
    items = [parse_override(o) for o in overrides] if isinstance(overrides, list) else \
        [(k.split("."), v) for k, v in overrides.items()]
    data = merge({}, data)
    for path, value in items:
        node = data
        for p in path[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(path)}: {p} is not a table")
            node = child
        node[path[-1]] = value
    return data


def value_at(data: Table, key: str) -> TomlValue:
    """The value of dotted option `key` in raw config data that sets it."""
    value: TomlValue = data
    for part in key.split("."):
        assert isinstance(value, dict), f"{key}: {part}'s parent is not a table"
        value = value[part]
    return value


def drop(data: Table, key: str) -> None:
    """Remove dotted option `key` from raw config data that sets it."""
    *parents, last = key.split(".")
    table = value_at(data, ".".join(parents)) if parents else data
    assert isinstance(table, dict), f"{key}: its parent is not a table"
    del table[last]


def top_table(path: Path) -> Table:
    """The file's own table, without its bases (read after _read_toml has checked the file)."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}


def explicit_keys(top: Table, overrides: list[str] | Table | None = None) -> list[str]:
    """The dotted keys a file's own table (not its base or sweep) and the overrides set explicitly."""
    def leaves(d: Table, prefix: str) -> list[str]:
        return [k for key, v in d.items() for k in (leaves(v, f"{prefix}{key}.") if isinstance(v, dict)
                                                    else [prefix + key])]
    keys = leaves({k: v for k, v in top.items() if k not in ("base", "sweep")}, "")
    items = overrides if isinstance(overrides, dict) else [".".join(parse_override(o)[0]) for o in overrides or []]
    return list(dict.fromkeys(keys + list(items)))
