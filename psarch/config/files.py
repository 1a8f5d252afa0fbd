"""Raw config data: TOML files with `base` inheritance, `--set` overrides, and which keys a user set
explicitly. The typed configuration built from it lives in psarch.config."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from psarch.errors import ConfigError, show


def merge(base: dict, top: dict) -> dict:
    """top's keys over base's, tables merged key by key; a new dict all the way down (inputs untouched)."""
    out = {k: merge(v, {}) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in top.items():
        out[k] = merge(out[k] if isinstance(out.get(k), dict) else {}, v) if isinstance(v, dict) else v
    return out


def read_toml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
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


def apply_overrides(data: dict[str, Any], overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    """Apply `section.key=value` strings (or a {dotted key: value} dict) on top of raw config data."""
    items = [parse_override(o) for o in overrides] if isinstance(overrides, list) else \
        [(k.split("."), v) for k, v in overrides.items()]
    data = merge({}, data)
    for path, value in items:
        node = data
        for p in path[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(path)}: {p} is not a table")
        node[path[-1]] = value
    return data


def top_table(path: Path) -> dict[str, Any]:
    """The file's own table, without its bases (read after _read_toml has checked the file)."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}


def explicit_keys(top: dict[str, Any], overrides: list[str] | dict[str, Any] | None = None) -> list[str]:
    """The dotted keys a file's own table (not its base or sweep) and the overrides set explicitly."""
    def leaves(d: dict[str, Any], prefix: str) -> list[str]:
        return [k for key, v in d.items() for k in (leaves(v, f"{prefix}{key}.") if isinstance(v, dict)
                                                    else [prefix + key])]
    keys = leaves({k: v for k, v in top.items() if k not in ("base", "sweep")}, "")
    items = overrides if isinstance(overrides, dict) else [".".join(parse_override(o)[0]) for o in overrides or []]
    return list(dict.fromkeys(keys + list(items)))
