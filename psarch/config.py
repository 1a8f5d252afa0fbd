"""Experiment configuration: typed dataclasses loaded from TOML, with `base` inheritance and overrides.

Precedence: dataclass defaults < TOML file (after its `base` chain) < `--set section.key=value`.
Every mistake stops the run before any process starts, with one line naming key, value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the key, the value and what is allowed."""


def _f(default: Any, doc: str, choices: tuple | None = None, min: float | None = None,
       max: float | None = None) -> Any:
    meta = {"doc": doc, "choices": choices, "min": min, "max": max}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _sub(cls: type) -> Any:
    return field(default_factory=cls, metadata={"doc": cls.__doc__})


@dataclass
class GPTConfig:
    """Decoder-only transformer (pre-LayerNorm, causal self-attention, GELU MLP)."""

    n_layer: int = _f(2, "number of transformer blocks", min=1)
    n_embd: int = _f(64, "model width", min=1)
    n_head: int = _f(4, "attention heads; must divide n_embd", min=1)
    mlp_ratio: int = _f(4, "MLP hidden width as a multiple of n_embd", min=1)


@dataclass
class MLPConfig:
    """Token embedding followed by an MLP that predicts the next token from the current one."""

    n_embd: int = _f(64, "embedding width", min=1)
    hidden: int = _f(256, "hidden width", min=1)
    n_layer: int = _f(2, "hidden layers", min=1)


@dataclass
class MarkovConfig:
    """Synthetic tokens from a random sparse Markov chain whose entropy rate is known exactly."""

    # Every rank builds the chain: O(vocab_size * branching) per power-iteration step, ~1 s at 2^16 states
    # with the default concentration, up to a minute for slow-mixing chains (concentration near 1e-6).
    vocab_size: int = _f(64, "number of states (tokens)", min=2, max=2**16)
    branching: int = _f(4, "successors per state (sparsity of the transition matrix)", min=1)
    concentration: float = _f(1.0, "Dirichlet concentration of each row's probabilities", min=1e-6)


@dataclass
class TextConfig:
    """Bytes of a text file (vocabulary 256); sequences start at random offsets."""

    path: str = _f("", "path of the text file (required for data = 'text')")


@dataclass
class WorkloadConfig:
    """What is trained: a built-in model and data, or a user's factory."""

    model: str = _f("gpt", "built-in model", choices=("gpt", "mlp"))
    data: str = _f("markov", "built-in data", choices=("markov", "text"))
    factory: str = _f("", "'package.module:function' returning a psarch.Workload; replaces model and data")
    seq_len: int = _f(32, "tokens per sequence", min=1)
    gpt: GPTConfig = _sub(GPTConfig)
    mlp: MLPConfig = _sub(MLPConfig)
    markov: MarkovConfig = _sub(MarkovConfig)
    text: TextConfig = _sub(TextConfig)


@dataclass
class TrainConfig:
    """The step loop and the optimizer; the same for every backend."""

    steps: int = _f(20, "optimizer steps to run", min=1)
    global_batch: int = _f(16, "samples per step across all workers", min=1)
    optimizer: str = _f("adamw", "optimizer", choices=("sgd", "adamw"))
    lr: float = _f(1e-3, "learning rate", min=0.0)
    momentum: float = _f(0.0, "SGD momentum", min=0.0)
    nesterov: bool = _f(False, "SGD Nesterov momentum")
    weight_decay: float = _f(0.0, "weight decay (decoupled for AdamW)", min=0.0)
    betas: list = _f([0.9, 0.999], "AdamW betas [beta1, beta2]")
    eps: float = _f(1e-8, "AdamW epsilon", min=0.0)
    precision: str = _f("fp32", "compute precision; bf16/fp16 keep fp32 master weights", choices=("fp32", "bf16", "fp16"))
    log_every: int = _f(10, "print a progress line every this many steps", min=1)
    warmup_steps: int = _f(-1, "steps left out of timing medians (-1: min(5, steps // 5))", min=-1)


@dataclass
class BackendConfig:
    """How workers synchronise. Options not used by the chosen kind are ignored."""

    kind: str = _f("single", "backend ('torch_*': PyTorch's own implementation, the peer)",
                   choices=("single", "ddp", "zero", "ps", "torch_ddp", "torch_zero", "torch_fsdp"))
    world_size: int = _f(1, "number of workers", min=1)
    device: str = _f("auto", "where ranks compute ('auto': cuda if available)", choices=("auto", "cpu", "cuda"))
    dist_backend: str = _f("auto", "torch.distributed backend ('auto': nccl when each rank has its own GPU, else gloo)",
                           choices=("auto", "gloo", "nccl"))
    comm: str = _f("ring", "ddp/zero communicator", choices=("ring", "native"))
    bucket_cap_mb: float = _f(25.0, "ddp: gradient bucket size in MiB", min=0.0)
    overlap_comm: bool = _f(True, "ddp/zero: start communication from autograd hooks during backward")
    stage: int = _f(1, "zero: 1 (optimizer state), 2 (+gradients), 3 (+parameters)", choices=(1, 2, 3))
    reduce_bucket_size: int = _f(5 * 10**8, "zero: elements per gradient reduce-scatter bucket", min=1)
    allgather_bucket_size: int = _f(5 * 10**8, "zero: elements per parameter all-gather bucket", min=1)
    prefetch_bucket_size: int = _f(5 * 10**7, "zero-3: elements gathered ahead of use", min=0)
    activation_checkpointing: bool = _f(False, "zero: recompute each unit's activations in backward")
    zero_units: str = _f("blocks", "zero: attribute of the model holding the nn.ModuleList whose children are "
                                   "the units (gathered one by one in stage 3, checkpointed one by one); "
                                   "'' for the whole model as one unit")
    mode: str = _f("sync", "ps update mode", choices=("sync", "async", "geo", "ssp"))
    servers: int = _f(1, "ps: number of server processes", min=1)
    k_steps: int = _f(4, "ps geo: local steps between pushes", min=1)
    geo_barrier: bool = _f(False, "ps geo: every round waits for all workers (Local SGD)")
    staleness_bound: int = _f(2, "ps ssp: most steps a worker may run ahead of the slowest", min=0)
    staleness_compensation: str = _f("none", "ps async: remedy for stale gradients", choices=("none", "lr", "dc"))
    dc_lambda: float = _f(0.04, "ps async dc: delay-compensation strength", min=0.0)
    host: str = _f("127.0.0.1", "ps: address servers bind to")
    server_addresses: list = _f([], "ps: 'tcp://host:port' of each server started with `psarch server` "
                                    "(empty: `psarch run` starts the servers itself)")
    timeout_s: float = _f(60.0, "seconds a rank or server waits for a peer before the run stops with an error", min=0.1)


@dataclass
class Config:
    """One experiment."""

    name: str = _f("", "run name (default: the config file's stem)")
    seed: int = _f(0, "global seed: model init and every step's global batch derive from it", min=0)
    out: str = _f("", "run folder (default: runs/<name>)")
    workload: WorkloadConfig = _sub(WorkloadConfig)
    train: TrainConfig = _sub(TrainConfig)
    backend: BackendConfig = _sub(BackendConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading

def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}.get(tp, str(tp))


def _show(value: Any) -> str:
    """A value as the user wrote it, on one line (TOML dates and times included)."""
    return json.dumps(value, default=str)


def _coerce(key: str, value: Any, f: dataclasses.Field) -> Any:
    tp = f.type if not isinstance(f.type, str) else eval(f.type, globals())  # annotations are postponed
    ok = (isinstance(value, bool) if tp is bool else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
          isinstance(value, tp))
    if not ok:
        raise ConfigError(f"{key} = {_show(value)}: expected {_type_name(tp)}")
    if tp is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key} = {_show(value)}: expected a finite number")
    choices, lo, hi = f.metadata.get("choices"), f.metadata.get("min"), f.metadata.get("max")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} = {_show(value)}: allowed values are {', '.join(json.dumps(c) for c in choices)}")
    if lo is not None and value < lo:
        raise ConfigError(f"{key} = {_show(value)}: must be >= {lo:g}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} = {_show(value)}: must be <= {hi:g}")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in fields:
            raise ConfigError(f"{key} = {_show(v)}: unknown key; allowed keys{' in [' + prefix[:-1] + ']' if prefix else ''} are "
                              f"{', '.join(sorted(fields))}")
        f = fields[k]
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            if not isinstance(v, dict):
                raise ConfigError(f"{key} = {_show(v)}: expected a table [{key}]")
            kwargs[k] = _build(f.default_factory, v, key + ".")
        else:
            kwargs[k] = _coerce(key, v, f)
    return cls(**kwargs)


def _merge(base: dict, top: dict) -> dict:
    """top's keys over base's, tables merged key by key; a new dict all the way down (inputs untouched)."""
    out = {k: _merge(v, {}) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in top.items():
        out[k] = _merge(out[k] if isinstance(out.get(k), dict) else {}, v) if isinstance(v, dict) else v
    return out


def _read_toml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
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
        raise ConfigError(f"base = {_show(base)}: expected a path string")
    return _merge(_read_toml(path.parent / base, seen + (path,)), data)


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
    data = _merge({}, data)
    for path, value in items:
        node = data
        for p in path[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(path)}: {p} is not a table")
        node[path[-1]] = value
    return data


def validate(cfg: Config) -> Config:
    """Checks that need several keys at once."""
    b, t, w = cfg.backend, cfg.train, cfg.workload
    name = Path(cfg.name)
    if name.is_absolute() or ".." in name.parts or not name.parts:
        # the run folder is runs/<name>: a name must stay inside runs/ ('sweep/point' is fine)
        raise ConfigError(f"name = {_show(cfg.name)}: expected a relative name without '..' parts, "
                          f"e.g. \"baseline\" or \"sweep/point\"")
    if t.global_batch % b.world_size:
        raise ConfigError(f"train.global_batch = {t.global_batch}: must be divisible by backend.world_size = {b.world_size}")
    if b.kind == "single" and b.world_size != 1:
        raise ConfigError(f"backend.world_size = {b.world_size}: backend.kind = \"single\" runs exactly 1 worker")
    if len(t.betas) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in t.betas):
        raise ConfigError(f"train.betas = {_show(t.betas)}: expected two numbers in [0, 1)")
    t.betas = [float(x) for x in t.betas]
    if t.nesterov and (t.optimizer != "sgd" or t.momentum <= 0):
        raise ConfigError("train.nesterov = true: needs train.optimizer = \"sgd\" and train.momentum > 0")
    if w.model == "gpt" and w.gpt.n_embd % w.gpt.n_head and not w.factory:
        raise ConfigError(f"workload.gpt.n_head = {w.gpt.n_head}: must divide workload.gpt.n_embd = {w.gpt.n_embd}")
    if w.data == "markov" and not w.factory and w.markov.branching > w.markov.vocab_size:
        raise ConfigError(f"workload.markov.branching = {w.markov.branching}: must be <= workload.markov.vocab_size "
                          f"= {w.markov.vocab_size}")
    if w.data == "text" and not w.factory and not w.text.path:
        raise ConfigError("workload.text.path = \"\": data = \"text\" needs the path of a text file")
    if w.factory:
        resolve_factory(w.factory)
    if b.server_addresses and (len(b.server_addresses) != b.servers
                               or not all(isinstance(a, str) and a for a in b.server_addresses)):
        raise ConfigError(f"backend.server_addresses = {_show(b.server_addresses)}: expected backend.servers = "
                          f"{b.servers} address strings like \"tcp://10.0.0.5:5555\"")
    if b.dist_backend == "nccl" and b.device == "cpu":
        raise ConfigError("backend.dist_backend = \"nccl\": needs backend.device = \"cuda\" (or \"auto\" on a GPU machine)")
    if b.kind in ("torch_zero", "torch_fsdp") and t.precision != "fp32":
        raise ConfigError(f"train.precision = \"{t.precision}\": backend.kind = \"{b.kind}\" (a PyTorch peer) runs "
                          f"fp32 only; use backend.kind = \"zero\" for bf16/fp16")
    return cfg


def check_machine(cfg: Config) -> Config:
    """Checks against this machine, made before any process starts: the device and the text file.
    Not part of validate(): a config written for GPU ranks stays valid on a CPU-only machine that only
    loads it (a standalone parameter server, a test reading config.json)."""
    b, w = cfg.backend, cfg.workload
    if b.device == "cuda" or b.dist_backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            key, value = ("backend.device", "cuda") if b.device == "cuda" else ("backend.dist_backend", "nccl")
            raise ConfigError(f"{key} = \"{value}\": no CUDA device is visible on this machine; "
                              f"use backend.device = \"cpu\" (or \"auto\") and backend.dist_backend = \"gloo\" (or \"auto\")")
    if w.data == "text" and not w.factory:
        path = Path(w.text.path)
        if not path.is_file():
            raise ConfigError(f"workload.text.path = {_show(w.text.path)}: no such file")
        size, need = path.stat().st_size, w.seq_len + 1  # a sequence and its next-token target
        if size < need:
            raise ConfigError(f"workload.text.path = {_show(w.text.path)}: the file has {size} bytes; "
                              f"workload.seq_len = {w.seq_len} needs at least {need}")
    return cfg


def resolve_factory(spec: str) -> Any:
    """The function a `workload.factory` spec names; checked here, before any rank starts."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise ConfigError(f"workload.factory = {json.dumps(spec)}: expected 'package.module:function'")
    # A module next to the config finds itself as under `python -m`: the `psarch` console script's
    # sys.path[0] is its bin folder, not the working directory. Spawned ranks inherit sys.path.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except Exception as e:  # ImportError, AttributeError, or the module's own error (a SyntaxError, say)
        raise ConfigError(f"workload.factory = {json.dumps(spec)}: cannot import it ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not callable(fn):
        raise ConfigError(f"workload.factory = {json.dumps(spec)}: {fn_name} is not a function")
    return fn


def from_dict(data: dict[str, Any], name: str = "") -> Config:
    """Build and validate a Config from raw (already merged) data."""
    cfg = _build(Config, data, "")
    if not cfg.name:
        cfg.name = name or "run"
    return validate(cfg)


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Load a TOML experiment (following `base`), apply overrides, validate. Raises ConfigError."""
    data = _read_toml(Path(path)) if path is not None else {}
    if overrides:
        data = apply_overrides(data, overrides)
    return from_dict(data, Path(path).stem if path is not None else "run")


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every field: the config vocabulary, for docs and `psarch keys`."""
    rows = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            rows += describe(f.default_factory, f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((prefix + f.name, default, f.metadata.get("doc", "")))
    return rows
