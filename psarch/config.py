"""Experiment configuration: typed dataclasses loaded from TOML, with `base` inheritance and overrides.

Precedence: dataclass defaults < TOML file (after its `base` chain) < `--set section.key=value`.
Every mistake stops the run before any process starts, with one line naming key, value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psarch.config_fields import _f, _sub
# ConfigError, parse_override and apply_overrides are part of this module's interface too
from psarch.config_files import (ConfigError, apply_overrides, explicit_keys, parse_override,  # noqa: F401
                                 read_toml, show, top_table)
# the [workload] classes are part of this module's interface, and _field_type evaluates their names here
from psarch.config_workload import (ClicksConfig, DLRMConfig, GPTConfig, MarkovConfig, MLPConfig,  # noqa: F401
                                    TextConfig, WorkloadConfig)
from psarch.machine import check_machine, resolve_factory  # noqa: F401  (part of this module's interface)


@dataclass
class TrainConfig:
    """The step loop and the optimizer; the same for every backend."""

    steps: int = _f(20, "optimizer steps to run", min=1)
    global_batch: int = _f(16, "samples per step across all workers", min=1)
    optimizer: str = _f("adamw", "optimizer", choices=("sgd", "adamw", "adagrad"))
    lr: float = _f(1e-3, "learning rate", min=0.0)
    momentum: float = _f(0.0, "SGD momentum", min=0.0)
    nesterov: bool = _f(False, "SGD Nesterov momentum")
    weight_decay: float = _f(0.0, "weight decay (decoupled for AdamW, L2 for SGD and Adagrad)", min=0.0)
    betas: list = _f([0.9, 0.999], "AdamW betas [beta1, beta2]")
    eps: float = _f(1e-8, "AdamW/Adagrad epsilon", min=0.0)
    initial_accumulator_value: float = _f(0.0, "Adagrad: starting value of every squared-gradient sum", min=0.0)
    precision: str = _f("fp32", "compute precision; bf16/fp16 keep fp32 master weights", choices=("fp32", "bf16", "fp16"))
    log_every: int = _f(10, "print a progress line every this many steps", min=1)
    warmup_steps: int = _f(-1, "steps left out of timing medians (-1: min(5, steps // 5))", min=-1)
    checkpoint_every: int = _f(0, "write a checkpoint under <run>/checkpoints/ every this many steps (0: never)", min=0)
    keep_checkpoints: int = _f(0, "keep only the newest this many checkpoints (0: all)", min=0)


# Which backends read an option (the `applies` of _f): one place for the launcher's check, the sweep's
# de-duplication and `psarch keys`. VARIANT_KEY names the option that selects a kind's variant.
VARIANT_KEY = {"ps": "mode", "zero": "stage"}
_PS: dict[str, tuple | None] = {"ps": None}
_GROUPED = {k: None for k in ("ddp", "zero", "ps", "torch_ddp", "torch_zero", "torch_fsdp")}  # not single
_DDP_ZERO = {"ddp": None, "zero": None}


@dataclass
class BackendConfig:
    """How workers synchronise. An option set explicitly must apply to the chosen backend (see applies())."""

    kind: str = _f("single", "backend ('torch_*': PyTorch's own implementation, the peer)",
                   choices=("single", "ddp", "zero", "ps", "torch_ddp", "torch_zero", "torch_fsdp"))
    world_size: int = _f(1, "number of workers", min=1)
    device: str = _f("auto", "where ranks compute ('auto': cuda if available)", choices=("auto", "cpu", "cuda"))
    dist_backend: str = _f("auto", "torch.distributed backend ('auto': nccl when each rank has its own GPU, else gloo)",
                           choices=("auto", "gloo", "nccl"), applies=_GROUPED)
    comm: str = _f("ring", "communicator", choices=("ring", "native"), applies=_DDP_ZERO)
    bucket_cap_mb: float = _f(25.0, "gradient bucket size in MiB", min=0.0,
                              applies={"ddp": None, "torch_ddp": None, "torch_zero": None})
    overlap_comm: bool = _f(True, "start communication from autograd hooks during backward", applies=_DDP_ZERO)
    stage: int = _f(1, "1 (optimizer state), 2 (+gradients), 3 (+parameters)", choices=(1, 2, 3),
                    applies={"zero": None})
    reduce_bucket_size: int = _f(5 * 10**8, "elements per gradient reduce-scatter bucket", min=1,
                                 applies={"zero": (1, 2)})
    allgather_bucket_size: int = _f(5 * 10**8, "elements per parameter all-gather bucket", min=1,
                                    applies={"zero": (1, 2)})
    prefetch_bucket_size: int = _f(5 * 10**7, "elements gathered ahead of use", min=0, applies={"zero": (3,)})
    activation_checkpointing: bool = _f(False, "recompute each unit's activations in backward", applies={"zero": None})
    measure_activations: bool = _f(False, "count the activation bytes kept for backward each step "
                                          "(saved_activation_bytes); off the hot path unless asked for",
                                   applies={"zero": None})
    zero_units: str = _f("blocks", "attribute of the model holding the nn.ModuleList whose children are "
                                   "the units (gathered one by one in stage 3, checkpointed one by one); "
                                   "'' for the whole model as one unit", applies={"zero": None, "torch_fsdp": None})
    mode: str = _f("sync", "update mode", choices=("sync", "async", "geo", "ssp"), applies=_PS)
    servers: int = _f(1, "number of server processes", min=1, applies=_PS)
    k_steps: int = _f(4, "local steps between pushes", min=1, applies={"ps": ("geo",)})
    geo_barrier: bool = _f(False, "every round waits for all workers (Local SGD)", applies={"ps": ("geo",)})
    staleness_bound: int = _f(2, "most steps a worker may run ahead of the slowest", min=0, applies={"ps": ("ssp",)})
    staleness_compensation: str = _f("none", "remedy for stale gradients", choices=("none", "lr", "dc"),
                                     applies={"ps": ("async", "ssp")})
    dc_lambda: float = _f(0.04, "delay-compensation strength (staleness_compensation = 'dc')", min=0.0,
                          applies={"ps": ("async", "ssp")})
    host: str = _f("127.0.0.1", "address servers bind to", applies=_PS)
    server_addresses: list = _f([], "'tcp://host:port' of each server started with `psarch server` "
                                    "(empty: `psarch run` starts the servers itself)", applies=_PS)
    embeddings: str = _f("dense", "how embedding tables move: as ordinary parameters ('dense'), only the "
                                  "touched rows' gradients ('rows', ddp and torch_ddp), or row-sharded over "
                                  "ranks ('sharded', ddp)",
                         choices=("dense", "rows", "sharded"), applies=_GROUPED)
    timeout_s: float = _f(60.0, "seconds a rank or server waits for a peer before the run stops with an error",
                          min=0.1, applies=_GROUPED)
    auth: str = _f("auto", "who may talk to a server: 'curve' (CurveZMQ keys), 'plain' (a password per worker), "
                           "'auto' (plain on loopback, curve when servers bind an address other machines reach), "
                           "'none' (loopback only)", choices=("auto", "curve", "plain", "none"), applies=_PS)
    keys: str = _f("", "folder of `psarch keygen` credentials ('': fresh ones per run; `psarch server` needs it)",
                   applies=_PS)
    heartbeat_s: float = _f(10.0, "ZeroMQ heartbeat interval; 0 turns heartbeats off", min=0.0, applies=_PS)
    heartbeat_timeout_s: float = _f(30.0, "a peer silent this long after a heartbeat (or mid-message, or "
                                          "mid-handshake) is dropped", min=0.1, applies=_PS)
    max_connections: int = _f(0, "most open connections per server, handshakes included (0: world_size + 16)",
                              min=0, applies=_PS)


@dataclass
class ClusterConfig:
    """An emulated cluster (a network namespace and a shaped link per node; needs root) and stragglers."""

    emulate: bool = _f(False, "every worker and PS server is a node with its own network namespace and link")
    link_mbps: float = _f(1000.0, "each node's link in Mbit/s, in each direction (full duplex)", min=0.001)
    server_link_mbps: float = _f(0.0, "PS servers' links in Mbit/s; 0 = same as link_mbps", min=0.0, applies=_PS)
    slow_workers: list = _f([], "ranks of workers that compute slower (works with emulate = false too)")
    slowdown: float = _f(1.0, "slow workers' compute time is multiplied by this", min=1.0)
    jitter: float = _f(0.0, "every worker's compute time is multiplied by exp(N(0, jitter)) each step, seeded",
                       min=0.0)

    @property
    def server_mbps(self) -> float:
        """A PS server's link rate in Mbit/s (server_link_mbps, or link_mbps where that is 0)."""
        return self.server_link_mbps or self.link_mbps


@dataclass
class Config:
    """One experiment."""

    name: str = _f("", "run name (default: the config file's stem)")
    seed: int = _f(0, "global seed: model init and every step's global batch derive from it", min=0)
    out: str = _f("", "run folder (default: runs/<name>)")
    workload: WorkloadConfig = _sub(WorkloadConfig)
    train: TrainConfig = _sub(TrainConfig)
    backend: BackendConfig = _sub(BackendConfig)
    cluster: ClusterConfig = _sub(ClusterConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading

def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}.get(tp, str(tp))


def _field_type(f: dataclasses.Field) -> type:
    return f.type if not isinstance(f.type, str) else eval(f.type, globals())  # annotations are postponed


def _coerce(key: str, value: Any, f: dataclasses.Field) -> Any:
    tp = _field_type(f)
    ok = (isinstance(value, bool) if tp is bool else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
          isinstance(value, tp))
    if not ok:
        raise ConfigError(f"{key} = {show(value)}: expected {_type_name(tp)}")
    if tp is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key} = {show(value)}: expected a finite number")
    choices, lo, hi = f.metadata.get("choices"), f.metadata.get("min"), f.metadata.get("max")
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
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            if not isinstance(v, dict):
                raise ConfigError(f"{key} = {show(v)}: expected a table [{key}]")
            kwargs[k] = _build(f.default_factory, v, key + ".")
        else:
            kwargs[k] = _coerce(key, v, f)
    return cls(**kwargs)


def validate(cfg: Config) -> Config:
    """Checks that need several keys at once."""
    b, t, w = cfg.backend, cfg.train, cfg.workload
    name = Path(cfg.name)
    if name.is_absolute() or ".." in name.parts or not name.parts:
        # the run folder is runs/<name>: a name must stay inside runs/ ('sweep/point' is fine)
        raise ConfigError(f"name = {show(cfg.name)}: expected a relative name without '..' parts, "
                          f"e.g. \"baseline\" or \"sweep/point\"")
    if t.global_batch % b.world_size:
        raise ConfigError(f"train.global_batch = {t.global_batch}: must be divisible by backend.world_size = {b.world_size}")
    if b.kind == "single" and b.world_size != 1:
        raise ConfigError(f"backend.world_size = {b.world_size}: backend.kind = \"single\" runs exactly 1 worker")
    if len(t.betas) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in t.betas):
        raise ConfigError(f"train.betas = {show(t.betas)}: expected two numbers in [0, 1)")
    t.betas = [float(x) for x in t.betas]
    if t.nesterov and (t.optimizer != "sgd" or t.momentum <= 0):
        raise ConfigError("train.nesterov = true: needs train.optimizer = \"sgd\" and train.momentum > 0")
    if t.momentum and t.optimizer != "sgd":   # torch's AdamW and Adagrad take no momentum: it would be ignored
        raise ConfigError(f"train.momentum = {t.momentum:g}: only train.optimizer = \"sgd\" has momentum, "
                          f"not \"{t.optimizer}\"; set it to 0")
    if t.initial_accumulator_value and t.optimizer != "adagrad":
        raise ConfigError(f"train.initial_accumulator_value = {t.initial_accumulator_value:g}: only train.optimizer = "
                          f"\"adagrad\" has an accumulator, not \"{t.optimizer}\"; set it to 0")
    if w.model == "gpt" and w.gpt.n_embd % w.gpt.n_head and not w.factory:
        raise ConfigError(f"workload.gpt.n_head = {w.gpt.n_head}: must divide workload.gpt.n_embd = {w.gpt.n_embd}")
    if w.data == "markov" and not w.factory and w.markov.branching > w.markov.vocab_size:
        raise ConfigError(f"workload.markov.branching = {w.markov.branching}: must be <= workload.markov.vocab_size "
                          f"= {w.markov.vocab_size}")
    if not w.factory and (w.model == "dlrm") != (w.data == "clicks"):
        key, value = ("workload.model", w.model) if w.model == "dlrm" else ("workload.data", w.data)
        raise ConfigError(f"{key} = \"{value}\": model \"dlrm\" and data \"clicks\" go together "
                          f"(a click model on click data)")
    for key in ("bottom_mlp", "top_mlp"):
        widths = getattr(w.dlrm, key)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in widths):
            raise ConfigError(f"workload.dlrm.{key} = {show(widths)}: expected a list of widths >= 1, e.g. [64, 32]")
    if b.embeddings == "rows" and b.kind == "ps":
        _check_ps_rows(cfg)
    elif b.embeddings == "rows" and b.kind not in ("ddp", "torch_ddp"):
        raise ConfigError(f"backend.embeddings = \"rows\": moving only the touched rows runs on backend.kind = "
                          f"\"ps\", \"ddp\" or \"torch_ddp\" so far (issue 11), not \"{b.kind}\"; \"dense\" runs there")
    elif b.embeddings == "rows" and (w.factory or w.model != "dlrm"):
        raise ConfigError("backend.embeddings = \"rows\": needs the built-in workload.model = \"dlrm\" (its tables "
                          "are what moves as rows, and theory reads their size from [workload.dlrm])")
    if b.embeddings == "sharded" and b.kind != "ddp":
        raise ConfigError(f"backend.embeddings = \"sharded\": row-sharded tables with all-to-all run on backend.kind "
                          f"= \"ddp\" only, not \"{b.kind}\"; use \"dense\" there")
    if b.embeddings == "sharded" and (w.factory or w.model != "dlrm"):
        raise ConfigError("backend.embeddings = \"sharded\": needs the built-in workload.model = \"dlrm\" (its "
                          "tables are what is sharded, and theory reads their size from [workload.dlrm])")
    if b.embeddings == "sharded" and t.precision == "fp16":
        raise ConfigError("train.precision = \"fp16\": backend.embeddings = \"sharded\" runs fp32 or bf16 (fp16 "
                          "would need one inf/nan verdict over every rank's shard before a step)")
    if b.embeddings == "rows" and b.kind == "torch_ddp":
        # the tables' gradients are torch sparse tensors, which torch's optimizers take only so
        why = ("train.optimizer = \"adamw\": torch's AdamW refuses sparse gradients; use \"sgd\" or \"adagrad\""
               if t.optimizer == "adamw" else
               f"train.weight_decay = {t.weight_decay:g}: torch's {t.optimizer} refuses weight decay on sparse "
               f"gradients; use 0" if t.weight_decay else
               f"train.precision = \"{t.precision}\": sparse gradients step in fp32 only" if t.precision != "fp32"
               else "")
        if why:
            raise ConfigError(f"{why} (backend.kind = \"torch_ddp\" with backend.embeddings = \"rows\" gives the "
                              f"tables sparse gradients; backend.kind = \"ddp\" takes any optimizer)")
    if w.data == "text" and not w.factory and not w.text.path:
        raise ConfigError("workload.text.path = \"\": data = \"text\" needs the path of a text file")
    if w.factory:
        resolve_factory(w.factory)
    if b.heartbeat_s and b.heartbeat_timeout_s <= b.heartbeat_s:
        raise ConfigError(f"backend.heartbeat_timeout_s = {b.heartbeat_timeout_s:g}: must be longer than "
                          f"backend.heartbeat_s = {b.heartbeat_s:g} (a peer gets at least one PING to answer)")
    if b.server_addresses and (len(b.server_addresses) != b.servers
                               or not all(isinstance(a, str) and a for a in b.server_addresses)):
        raise ConfigError(f"backend.server_addresses = {show(b.server_addresses)}: expected backend.servers = "
                          f"{b.servers} address strings like \"tcp://10.0.0.5:5555\"")
    c = cfg.cluster
    if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < b.world_size for r in c.slow_workers) \
            or len(set(c.slow_workers)) != len(c.slow_workers):
        raise ConfigError(f"cluster.slow_workers = {show(c.slow_workers)}: expected distinct worker ranks "
                          f"in 0..{b.world_size - 1} (backend.world_size = {b.world_size})")
    if b.dist_backend == "nccl" and b.device == "cpu":
        raise ConfigError("backend.dist_backend = \"nccl\": needs backend.device = \"cuda\" (or \"auto\" on a GPU machine)")
    if b.kind in ("torch_zero", "torch_fsdp") and t.precision != "fp32":
        raise ConfigError(f"train.precision = \"{t.precision}\": backend.kind = \"{b.kind}\" (a PyTorch peer) runs "
                          f"fp32 only; use backend.kind = \"zero\" for bf16/fp16")
    return cfg


def _check_ps_rows(cfg: Config) -> None:
    """What the parameter server's embedding rows (psarch/ps/rows.py) do not do (yet)."""
    b, t = cfg.backend, cfg.train
    why = ("workload.factory: the tables live in the built-in dlrm model" if cfg.workload.factory else
           f"workload.model = \"{cfg.workload.model}\": the tables live in the dlrm model" if cfg.workload.model != "dlrm" else
           f"train.precision = \"{t.precision}\": rows move and are updated in fp32 only (no bf16/fp16 row "
           f"pulls, no loss scaling of pushed rows)" if t.precision != "fp32" else
           f"backend.staleness_compensation = \"{b.staleness_compensation}\": rows are updated without "
           f"compensation" if b.staleness_compensation != "none" else
           f"train.momentum = {t.momentum:g}: row-wise SGD has no momentum (it would move untouched rows)"
           if t.optimizer == "sgd" and t.momentum else
           "backend.server_addresses: `psarch server` does not hold rows" if b.server_addresses else None)
    if why:
        raise ConfigError(f"backend.embeddings = \"rows\" with {why}")


def from_dict(data: dict[str, Any], name: str = "") -> Config:
    """Build and validate a Config from raw (already merged) data."""
    cfg = _build(Config, data, "")
    if not cfg.name:
        cfg.name = name or "run"
    return validate(cfg)


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Load a TOML experiment (following `base`), apply overrides, validate. Raises ConfigError.

    Every option set in the file itself or by an override must apply to the chosen backend. Options from a
    `base` file are shared defaults (one base may serve every backend) and are not checked; nor are the
    options of a file with a [sweep] table, which the sweep checks against its points."""
    top = top_table(Path(path)) if path is not None else {}
    data = read_toml(Path(path)) if path is not None else {}
    if overrides:
        data = apply_overrides(data, overrides)
    cfg = from_dict(data, Path(path).stem if path is not None else "run")
    if "sweep" not in top:
        check_applies(cfg, explicit_keys(top, overrides))
    return cfg


def _field(key: str) -> dataclasses.Field:
    cls, parts = Config, key.split(".")
    for i, part in enumerate(parts):
        f = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if f is None:
            raise ConfigError(f"{key}: unknown key")
        if i + 1 < len(parts):
            cls = f.default_factory  # a section: the sub-config's class
    return f


def allowed_values(key: str) -> str:
    """What option `key` accepts, in words: its choices, or its type and bounds (for `psarch keys`)."""
    m = _field(key).metadata
    if m.get("choices"):
        return " | ".join(json.dumps(c) for c in m["choices"])
    name = {int: "integer", float: "number", str: "string", bool: "true | false", list: "list"}[_field_type(_field(key))]
    lo, hi = m.get("min"), m.get("max")
    return (f"{name} in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else
            f"{name} >= {lo:g}" if lo is not None else f"{name} <= {hi:g}" if hi is not None else name)


def applies(key: str, cfg: Config) -> bool:
    """Whether the backend cfg chooses reads option `key` (dotted, e.g. "backend.k_steps")."""
    where = _field(key).metadata.get("applies")
    if where is None:
        return True
    kind = cfg.backend.kind
    return kind in where and (where[kind] is None or getattr(cfg.backend, VARIANT_KEY[kind]) in where[kind])


def applies_to(key: str) -> str:
    """Where option `key` applies, in words, e.g. 'backend.kind = "ps" with backend.mode = "geo"'."""
    where = _field(key).metadata.get("applies")
    if where is None:
        return "every backend"
    plain = [json.dumps(k) for k, variants in where.items() if variants is None]
    parts = [f"backend.kind = {', '.join(plain)}"] if plain else []
    parts += [f"backend.kind = {json.dumps(k)} with backend.{VARIANT_KEY[k]} = {', '.join(json.dumps(v) for v in vs)}"
              for k, vs in where.items() if vs is not None]
    return " or ".join(parts)


def check_applies(cfg: Config, keys: list[str]) -> None:
    """A ConfigError for the first of `keys` that the chosen backend does not read."""
    for key in keys:
        if not applies(key, cfg):
            value = cfg
            for part in key.split("."):
                value = getattr(value, part)
            kind = cfg.backend.kind
            this = f"backend.kind = {json.dumps(kind)}" + (
                f", backend.{VARIANT_KEY[kind]} = {show(getattr(cfg.backend, VARIANT_KEY[kind]))}"
                if kind in VARIANT_KEY else "")
            raise ConfigError(f"{key} = {show(value)}: applies only to {applies_to(key)}; this run has {this} "
                              f"(remove the option or choose a backend that reads it)")


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
