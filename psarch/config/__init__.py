"""Experiment configuration: typed dataclasses loaded from TOML, with `base` inheritance and overrides.

Precedence: dataclass defaults < TOML file (after its `base` chain) < `--set section.key=value`.
Every mistake stops the run before any process starts, with one line naming key, value and what is allowed.
The [backend] section is the core's options (below) plus the options each registered backend declares
(BackendSpec.options), composed into one dataclass, BackendConfig, when first needed.

This package: the Config schema and loading (here), `fields.py` (`option` and `section`: how an option is declared,
by the core and by every backend's spec), `files.py` (TOML, `base`, `--set`), `workload.py` (the [workload]
sections), `faults.py` (the [faults] section) and `rules.py` (the checks across keys, made before any process
starts).
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psarch.config.fields import option, section, choices_of
from psarch.config.faults import FaultsConfig
# parse_override and apply_overrides are part of this module's interface too, and so is ConfigError (declared in
# psarch.errors, which imports nothing, so that the cluster's device profiles and the machine checks this package
# runs can raise it without importing this package)
from psarch.config.files import (apply_overrides, explicit_keys, parse_override, read_toml,  # noqa: F401
                                 top_table)
# the [workload] classes are part of this module's interface, and _field_type evaluates their names here
from psarch.config.workload import (ClicksConfig, DLRMConfig, GPTConfig, MarkovConfig, MLPConfig,  # noqa: F401
                                    TextConfig, WorkloadConfig)
from psarch.errors import ConfigError, show
from psarch.machine import check_machine, resolve_factory  # noqa: F401  (part of this module's interface)
from psarch import registry


@dataclass
class TrainConfig:
    """The step loop and the optimizer; the same for every backend."""

    steps: int = option(20, "optimizer steps to run", min=1)
    global_batch: int = option(16, "samples per step across all workers", min=1)
    optimizer: str = option("adamw", "optimizer", choices=("sgd", "adamw", "adagrad"))
    lr: float = option(1e-3, "learning rate", min=0.0)
    momentum: float = option(0.0, "SGD momentum", min=0.0)
    nesterov: bool = option(False, "SGD Nesterov momentum")
    weight_decay: float = option(0.0, "weight decay (decoupled for AdamW, L2 for SGD and Adagrad)", min=0.0)
    betas: list = option([0.9, 0.999], "AdamW betas [beta1, beta2]")
    eps: float = option(1e-8, "AdamW/Adagrad epsilon", min=0.0)
    initial_accumulator_value: float = option(0.0, "Adagrad: starting value of every squared-gradient sum", min=0.0)
    precision: str = option("fp32", "compute precision; bf16/fp16 keep fp32 master weights", choices=("fp32", "bf16", "fp16"))
    log_every: int = option(10, "print a progress line every this many steps", min=1)
    warmup_steps: int = option(-1, "steps left out of timing medians (-1: min(5, steps // 5))", min=-1)
    checkpoint_every: int = option(0, "write a checkpoint under <run>/checkpoints/ every this many steps (0: never)", min=0)
    keep_checkpoints: int = option(0, "keep only the newest this many checkpoints (0: all)", min=0)
    tensorboard: bool = option(False, "also write each progress line's loss, samples/s and bytes sent as TensorBoard "
                                      "scalars under <run>/tensorboard/ (pip install psarch[tensorboard])")


@dataclass
class CoreBackendConfig:
    """How workers synchronise: the options of every backend; each backend adds its own (`psarch keys`).
    An option set explicitly must apply to the chosen backend (`applies`, below)."""

    kind: str = option("single", "backend ('torch_*': PyTorch's own implementation, the peer)", choices=registry.kinds)
    world_size: int = option(1, "number of workers", min=1)
    device: str = option("auto", "where ranks compute ('auto': cuda if available)", choices=("auto", "cpu", "cuda"))
    dist_backend: str = option("auto", "torch.distributed backend ('auto': nccl when each rank has its own GPU, else gloo)",
                               choices=("auto", "gloo", "nccl"), per_backend=True)
    embeddings: str = option("dense", "how embedding tables move: as ordinary parameters ('dense'), only the "
                                      "touched rows ('rows'), or row-sharded over ranks ('sharded')",
                             choices=("dense", "rows", "sharded"))
    timeout_s: float = option(60.0, "seconds a rank or server waits for a peer before the run stops with an error",
                              min=0.1, per_backend=True)


_backend_class: tuple[tuple[type, ...], type] | None = None


def backend_config_class() -> type:
    """The [backend] section's dataclass: the core's options and every registered backend's, one field each
    (composed again when the registered backends' options change)."""
    global _backend_class
    parts = tuple(dict.fromkeys(s.options for s in registry.specs() if s.options is not None))
    if _backend_class is None or _backend_class[0] != parts:
        seen: dict[str, type] = {f.name: CoreBackendConfig for f in dataclasses.fields(CoreBackendConfig)}
        for part in parts:
            for f in dataclasses.fields(part):
                if f.name in seen:
                    raise ValueError(f"backend.{f.name} is declared twice: by {seen[f.name].__qualname__} and by "
                                     f"{part.__qualname__} (a backend that reads another's option lists it in `reads`)")
                seen[f.name] = part
        cls = dataclasses.make_dataclass("BackendConfig", [], bases=(*parts[::-1], CoreBackendConfig))
        cls.__doc__, cls.__module__ = CoreBackendConfig.__doc__, __name__
        _backend_class = (parts, cls)
    return _backend_class[1]


def __getattr__(name: str) -> Any:   # `from psarch.config import BackendConfig`: the composed class
    if name == "BackendConfig":
        return backend_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _device_names() -> tuple[str, ...]:
    from psarch.cluster.device import MEASURED, PROFILES   # its package imports this module
    return (MEASURED, *PROFILES)


@dataclass
class ClusterConfig:
    """An emulated cluster (a network namespace and a shaped link per node; needs root) and stragglers."""

    emulate: bool = option(False, "every worker and service process (PS server) is a node with its own network "
                                  "namespace and link")
    link_mbps: float = option(1000.0, "each node's link in Mbit/s, in each direction (full duplex)", min=0.001)
    server_link_mbps: float = option(0.0, "service nodes' (PS servers') links in Mbit/s; 0 = same as link_mbps",
                                     min=0.0, per_backend=True)
    slow_workers: list = option([], "ranks of workers that compute slower (works with emulate = false too)")
    slowdown: float = option(1.0, "slow workers' compute time is multiplied by this", min=1.0)
    jitter: float = option(0.0, "every worker's compute time is multiplied by exp(N(0, jitter)) each step, seeded",
                           min=0.0)
    device: str = option("cpu-measured", "the device every worker stands for: 'cpu-measured' computes as this machine "
                                         "does; a profile's workers compute for real, then wait out the step's modelled "
                                         "time, FLOPs / (peak TFLOPS x mfu)", choices=_device_names)
    device_tflops: float = option(0.0, "a custom device's peak TFLOPS at train.precision, instead of a profile's "
                                       "(0: cluster.device's)", min=0.0)
    mfu: float = option(0.4, "model FLOPs utilisation in (0, 1]: the fraction of the device's peak the workload "
                             "attains", min=0.0, max=1.0)
    dilation: float | str = option("auto", "the emulation runs D times slower than the cluster: links at link_mbps / D, "
                                           "modelled compute x D, every reported time / D ('auto': the smallest D, with "
                                           "margin, that this machine's compute and per-message costs fit; 1 without a "
                                           "modelled device or without emulate)", min=1.0, named=("auto",))

    @property
    def server_mbps(self) -> float:
        """A service node's link rate in Mbit/s (server_link_mbps, or link_mbps where that is 0)."""
        return self.server_link_mbps or self.link_mbps


# keys that change no run, only how reports read it: a sweep does not run a point again for them, and
# `--resume` may change them
REPORT_ONLY = ("convergence_target",)


@dataclass
class Config:
    """One experiment."""

    name: str = option("", "run name (default: the config file's stem)")
    label: str = option("", "a run's name in reports and plots; default: its folder")
    seed: int = option(0, "global seed: model init and every step's global batch derive from it", min=0)
    out: str = option("", "run folder (default: runs/<name>)")
    convergence_target: float = option(0.1, "psarch compare's convergence target (changes no run): a run has reached it "
                                       "once its 10-step mean gap to the entropy floor falls below this fraction of "
                                       "its workload's initial gap (compare --target-gap gives an absolute gap instead)",
                                       min=0.001, max=1.0)
    workload: WorkloadConfig = section(WorkloadConfig)
    train: TrainConfig = section(TrainConfig)
    backend: Any = section(backend_config_class, CoreBackendConfig.__doc__)
    cluster: ClusterConfig = section(ClusterConfig)
    faults: FaultsConfig = section(FaultsConfig)
    started_from: dict = option({}, "the checkpoint a --from run started from: path, step and the config_sha256 of "
                                    "the run that wrote it (kept when the run is resumed)", recorded=True)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading

def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}.get(tp, str(tp))


def field_type(f: dataclasses.Field) -> type:
    """The type a field's values are checked as (a field with named values, `T | str`: T)."""
    tp = f.type if not isinstance(f.type, str) else eval(f.type, globals())  # annotations are postponed
    return next(t for t in typing.get_args(tp) if t is not str) if f.metadata.get("named") else tp


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


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in fields:
            raise ConfigError(f"{key} = {show(v)}: unknown key; allowed keys{' in [' + prefix[:-1] + ']' if prefix else ''} are "
                              f"{', '.join(sorted(fields))}")
        f = fields[k]
        if "section" in f.metadata:
            if not isinstance(v, dict):
                raise ConfigError(f"{key} = {show(v)}: expected a table [{key}]")
            kwargs[k] = _build(f.metadata["section"](), v, key + ".")
        else:
            kwargs[k] = _coerce(key, v, f)
    return cls(**kwargs)


def from_dict(data: dict[str, Any], name: str = "") -> Config:
    """Build and validate a Config from raw (already merged) data."""
    from psarch.config.rules import validate

    cfg = _build(Config, data, "")
    if not cfg.name:
        cfg.name = name or "run"
    return validate(cfg)


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None,
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
    cfg = from_dict(merged, stem)
    if "sweep" in top:
        return cfg
    set_keys = explicit_keys({}, overrides)
    replaced = [k for k in explicit_keys(top, overrides) if k in FACTORY_REPLACES and cfg.workload.factory]
    check_applies(cfg, [k for k in set_keys if k not in replaced])
    unread = [k for k in explicit_keys(top) if k not in set_keys + replaced and not applies(k, cfg)]
    alone = _file_alone(data, stem) if unread and overrides else None
    check_applies(cfg, [k for k in unread if alone is None or not applies(k, alone)])   # the file's own mistake
    if not unread + replaced:
        return cfg
    by_reason: dict[str, list[str]] = {}
    for key in replaced + unread:
        # a key not set by --set came from the file, so there is one
        where = "--set" if key in set_keys or path is None else f"set in {Path(path).name}"
        by_reason.setdefault(_why_unread(key, cfg), []).append(f"{key} = {show(_value(cfg, key))} ({where})")
        _drop(merged, key)
    for why, keys in by_reason.items():
        if notes is not None:
            notes.append(f"{', '.join(keys)} {'is' if len(keys) == 1 else 'are'} not read by this run: {why}; dropped")
    return from_dict(merged, stem)


def _refuse_recorded(data: dict[str, Any]) -> None:
    for f in dataclasses.fields(Config):
        if f.metadata.get("recorded") and f.name in data:
            raise ConfigError(f"{f.name} = {show(data[f.name])}: psarch records it in config.json; it is not a "
                              f"setting (remove it)")


def _file_alone(data: dict[str, Any], stem: str) -> Config | None:
    """The config the file makes without overrides, or None where it is not valid by itself."""
    try:
        return from_dict(data, stem)
    except ConfigError:
        return None


def _drop(data: dict[str, Any], key: str) -> None:
    *parents, last = key.split(".")
    for part in parents:
        data = data[part]
    del data[last]


def _value(cfg: Config, key: str) -> Any:
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def field_of(key: str) -> dataclasses.Field:
    """The declaration of dotted option `key` (e.g. "backend.k_steps")."""
    cls, parts = Config, key.split(".")
    for i, part in enumerate(parts):
        f = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if f is None or (i + 1 < len(parts)) != ("section" in f.metadata):
            raise ConfigError(f"{key}: unknown key")
        if i + 1 < len(parts):
            cls = f.metadata["section"]()
    assert f is not None    # checked in the loop, which runs at least once (split gives one part or more)
    return f


# ---------------------------------------------------------------- which options a run reads
# Every backend reads the core's options but those marked per-backend; a backend's own options
# (BackendSpec.options) and the per-backend ones apply where its spec says it reads them (BackendSpec.reads).
# One place for the launcher's check, the sweep's de-duplication and `psarch keys`.

_CORE_BACKEND = {f"backend.{f.name}" for f in dataclasses.fields(CoreBackendConfig)}


def per_backend(key: str) -> bool:
    """Whether only some backends read option `key`: a backend's own option, or one the core marks so."""
    f = field_of(key)
    return f.metadata.get("per_backend", False) or (key.startswith("backend.") and key not in _CORE_BACKEND)


def applies(key: str, cfg: Config) -> bool:
    """Whether the backend cfg chooses reads option `key` (dotted, e.g. "backend.k_steps")."""
    return not per_backend(key) or registry.spec_of(cfg).reads_option(key, cfg)


def applies_to(key: str) -> str:
    """Where option `key` applies, in words, e.g. 'backend.kind = "ps" with backend.mode = "geo"'."""
    if not per_backend(key):
        return "every backend"
    readers = [(s, s.option_keys()[key]) for s in registry.specs() if key in s.option_keys()]
    plain = [json.dumps(s.kind) for s, variants in readers if variants is None]
    parts = [f"backend.kind = {', '.join(plain)}"] if plain else []
    parts += [f"backend.kind = {json.dumps(s.kind)} with backend.{s.variant_key} = "
              f"{', '.join(json.dumps(v) for v in variants)}" for s, variants in readers if variants is not None]
    return " or ".join(parts) or "no registered backend"


FACTORY_REPLACES = ("workload.model", "workload.data")   # a factory is given the Config: it may read the rest


def _why_unread(key: str, cfg: Config) -> str:
    if cfg.workload.factory and key in FACTORY_REPLACES:
        return f"workload.factory = {show(cfg.workload.factory)} replaces the built-in model and data"
    spec = registry.spec_of(cfg)
    this = f"backend.kind = {json.dumps(spec.kind)}" + (
        f", backend.{spec.variant_key} = {show(getattr(cfg.backend, spec.variant_key))}" if spec.variant_key else "")
    return f"applies only to {applies_to(key)}; this run has {this}"


def check_applies(cfg: Config, keys: list[str]) -> None:
    """A ConfigError for the first of `keys` that the chosen backend does not read."""
    for key in keys:
        if not applies(key, cfg):
            raise ConfigError(f"{key} = {show(_value(cfg, key))}: {_why_unread(key, cfg)} "
                              f"(remove the option or choose a backend that reads it)")


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
    for f in dataclasses.fields(cls):
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
