"""Checks of a config that need several keys at once (psarch.config.from_dict runs them): the core's, then
what the chosen backend declares it runs (precisions, embedding treatments, world size) and its own rules
(BackendSpec.check). A mistake is one ConfigError naming the key, the value and what is allowed."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psarch import registry
from psarch.cluster import device
from psarch.config.faults import KILL, SHRINK, Fault, check_startup, faults, shrunk
from psarch.errors import ConfigError, show
from psarch.machine import resolve_factory

if TYPE_CHECKING:
    from psarch.config import Config


def validate(cfg: Config) -> Config:
    """Every check that needs several keys; returns cfg (betas normalised to floats)."""
    _check_name(cfg)
    _check_train(cfg)
    _check_compression(cfg)
    _check_workload(cfg)
    _check_cluster(cfg)
    spec = registry.spec_of(cfg)
    check_capabilities(spec, cfg)
    _check_embeddings(cfg)
    spec.check(cfg)
    check_startup(cfg)
    struck = faults(cfg)   # after the backend's own checks: a server's fault asks the spec how many servers it starts
    if cfg.faults.restart == SHRINK:
        _check_shrink(cfg, struck)
    return cfg


def _check_shrink(cfg: Config, out: list[Fault]) -> None:
    """A run that shrinks must run at N - 1 after its first kill (the backend's layout, the global batch cut in
    N - 1 shards, the faults still to strike, each naming a rank of the shrunk world), and so on after each kill
    (the shrunk world's config is checked the same way)."""
    this = f"faults.restart = {show(SHRINK)}"
    why = registry.spec_of(cfg).shrink_refusal(cfg)
    if why:
        raise ConfigError(f"{this}: {why}")
    kill = next((f for f in out if f.action == KILL), None)
    if kill is None:
        return
    other = next((f for f in out if f.step == kill.step and f is not kill), None)
    if other is not None:   # which of them strikes before the world stops is timing's: the shrunk world's faults too
        raise ConfigError(f"{this}: {other.node} {other.action} at step {kill.step}, the step {kill.node} is killed; "
                          f"a world that shrinks stops at a kill, so give each kill a step of its own")
    n = cfg.backend.world_size - 1
    try:
        validate(shrunk(cfg, lambda action, e: e["step"] <= kill.step))   # and so on after its own kills
    except ConfigError as e:
        raise ConfigError(f"{this}: {kill.node} killed at step {kill.step} restarts the world at "
                          f"backend.world_size = {n}, where {e}") from None


def _check_name(cfg: Config) -> None:
    name = Path(cfg.name)
    if name.is_absolute() or ".." in name.parts or not name.parts:
        # the run folder is runs/<name>: a name must stay inside runs/ ('sweep/point' is fine)
        raise ConfigError(f"name = {show(cfg.name)}: expected a relative name without '..' parts, "
                          f"e.g. \"baseline\" or \"sweep/point\"")


def _check_train(cfg: Config) -> None:
    b, t = cfg.backend, cfg.train
    shards = registry.spec_of(cfg).batch_shard(cfg, 0, b.world_size)[1]
    if t.global_batch % shards:
        raise ConfigError(f"train.global_batch = {t.global_batch}: must be divisible by backend.world_size = {b.world_size}"
                          if shards == b.world_size else
                          f"train.global_batch = {t.global_batch}: must be divisible by the {shards} shards of the "
                          f"global batch that backend.kind = \"{b.kind}\" reads")
    if len(t.betas) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in t.betas):
        raise ConfigError(f"train.betas = {show(t.betas)}: expected two numbers in [0, 1)")
    t.betas = [float(x) for x in t.betas]
    if not all(isinstance(x, int) and not isinstance(x, bool) and -t.steps <= x < t.steps for x in t.trace_steps):
        raise ConfigError(f"train.trace_steps = {show(t.trace_steps)}: expected step numbers in [-{t.steps}, "
                          f"{t.steps}) (train.steps = {t.steps}; negative counts from the end)")
    if t.nesterov and (t.optimizer != "sgd" or t.momentum <= 0):
        raise ConfigError("train.nesterov = true: needs train.optimizer = \"sgd\" and train.momentum > 0")
    if t.momentum and t.optimizer != "sgd":   # torch's AdamW and Adagrad take no momentum: it would be ignored
        raise ConfigError(f"train.momentum = {t.momentum:g}: only train.optimizer = \"sgd\" has momentum, "
                          f"not \"{t.optimizer}\"; set it to 0")
    if t.initial_accumulator_value and t.optimizer != "adagrad":
        raise ConfigError(f"train.initial_accumulator_value = {t.initial_accumulator_value:g}: only train.optimizer = "
                          f"\"adagrad\" has an accumulator, not \"{t.optimizer}\"; set it to 0")
    for key in ("trainable", "lora_targets"):
        value = getattr(t, key)
        if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
            raise ConfigError(f"train.{key} = {show(value)}: expected a list of parameter or module names or glob "
                              f"patterns, e.g. [\"head.weight\", \"blocks.*.attn.*\"]")
    defaults = type(t)()
    changed = [k for k in ("lora_alpha", "lora_targets") if getattr(t, k) != getattr(defaults, k)]
    if not t.lora_rank and changed:
        raise ConfigError(f"train.{changed[0]} = {show(getattr(t, changed[0]))}: applies only with LoRA adapters; "
                          f"set train.lora_rank > 0")
    if t.lora_rank and not t.lora_targets:
        raise ConfigError("train.lora_targets = []: LoRA (train.lora_rank > 0) needs the linear layers to adapt, "
                          "e.g. [\"*\"] (every nn.Linear)")
    if b.dist_backend == "nccl" and b.device == "cpu":
        raise ConfigError("backend.dist_backend = \"nccl\": needs backend.device = \"cuda\" (or \"auto\" on a GPU machine)")


def _check_compression(cfg: Config) -> None:
    """Each compression's own options only with it; the casts from fp32 only; error feedback without a loss scale."""
    t = cfg.train
    defaults = {f.name: f.default for f in dataclasses.fields(t)}
    for key, owner in (("topk_ratio", "topk"), ("powersgd_rank", "powersgd"), ("powersgd_warmup_steps", "powersgd")):
        if t.compression != owner and getattr(t, key) != defaults[key]:
            raise ConfigError(f"train.{key} = {show(getattr(t, key))}: only train.compression = \"{owner}\" reads it, "
                              f"not \"{t.compression}\"")
    if t.compression in ("fp16", "bf16") and t.precision != "fp32":
        raise ConfigError(f"train.compression = \"{t.compression}\": the gradients are already 2 bytes at "
                          f"train.precision = \"{t.precision}\"; the cast applies to train.precision = \"fp32\"")
    if t.compression in ("topk", "powersgd") and t.precision == "fp16":
        raise ConfigError(f"train.compression = \"{t.compression}\": its error feedback would carry gradients scaled "
                          f"by fp16's changing loss scale; use train.precision = \"fp32\" or \"bf16\"")
    spec = registry.spec_of(cfg)
    if t.compression in ("topk", "powersgd") and t.checkpoint_every and t.compression in spec.compressions \
            and not spec.checkpoints_compression:
        kinds = [s.kind for s in registry.specs() if s.checkpoints_compression]
        raise ConfigError(f"train.checkpoint_every = {t.checkpoint_every}: the error feedback of train.compression = "
                          f"\"{t.compression}\" is not in backend.kind = \"{spec.kind}\"'s checkpoints yet, so a "
                          f"resumed run would not continue this one; use 0 (or backend.kind = "
                          f"{', '.join(json.dumps(k) for k in kinds)})")


def _check_workload(cfg: Config) -> None:
    w = cfg.workload
    if w.factory:
        resolve_factory(w.factory)
        return
    if w.model == "gpt" and w.gpt.n_embd % w.gpt.n_head:
        raise ConfigError(f"workload.gpt.n_head = {w.gpt.n_head}: must divide workload.gpt.n_embd = {w.gpt.n_embd}")
    if w.data == "markov" and w.markov.branching > w.markov.vocab_size:
        raise ConfigError(f"workload.markov.branching = {w.markov.branching}: must be <= workload.markov.vocab_size "
                          f"= {w.markov.vocab_size}")
    if (w.model == "dlrm") != (w.data == "clicks"):
        key, value = ("workload.model", w.model) if w.model == "dlrm" else ("workload.data", w.data)
        raise ConfigError(f"{key} = \"{value}\": model \"dlrm\" and data \"clicks\" go together "
                          f"(a click model on click data)")
    for key in ("bottom_mlp", "top_mlp"):
        widths = getattr(w.dlrm, key)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in widths):
            raise ConfigError(f"workload.dlrm.{key} = {show(widths)}: expected a list of widths >= 1, e.g. [64, 32]")
    if w.data == "text" and not w.text.path:
        raise ConfigError("workload.text.path = \"\": data = \"text\" needs the path of a text file")


def _check_embeddings(cfg: Config) -> None:
    """Embedding tables that move otherwise than dense are the dlrm model's (theory reads their size there)."""
    e, w = cfg.backend.embeddings, cfg.workload
    if e != "dense" and (w.factory or w.model != "dlrm"):
        raise ConfigError(f"backend.embeddings = \"{e}\": needs the built-in workload.model = \"dlrm\" (its tables "
                          f"are what moves, and theory reads their size from [workload.dlrm])")


def _check_cluster(cfg: Config) -> None:
    c, n = cfg.cluster, cfg.backend.world_size
    if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < n for r in c.slow_workers) \
            or len(set(c.slow_workers)) != len(c.slow_workers):
        raise ConfigError(f"cluster.slow_workers = {show(c.slow_workers)}: expected distinct worker ranks "
                          f"in 0..{n - 1} (backend.world_size = {n})")
    device.check(cfg)   # the virtual device's and dilation's rules


def check_capabilities(spec: Any, cfg: Config) -> None:
    """What `spec` declares it runs: world sizes, precisions, embedding treatments."""
    b, t = cfg.backend, cfg.train
    this = f"backend.kind = \"{spec.kind}\""
    if spec.max_world_size is not None and b.world_size > spec.max_world_size:
        raise ConfigError(f"backend.world_size = {b.world_size}: {this} runs exactly {spec.max_world_size} worker"
                          if spec.max_world_size == 1 else
                          f"backend.world_size = {b.world_size}: {this} runs at most {spec.max_world_size} workers")
    if (t.trainable or t.lora_rank) and not spec.trains_subsets:
        key = f"train.trainable = {show(t.trainable)}" if t.trainable else f"train.lora_rank = {t.lora_rank}"
        subsets = [s.kind for s in registry.specs() if s.trains_subsets]
        raise ConfigError(f"{key}: {this} trains every parameter; frozen parameters and LoRA run on backend.kind = "
                          f"{', '.join(json.dumps(k) for k in subsets)}")
    if (t.trainable or t.lora_rank) and b.embeddings not in spec.subset_embeddings:
        raise ConfigError(f"backend.embeddings = \"{b.embeddings}\": frozen parameters and LoRA (train.trainable, "
                          f"train.lora_rank) run on {this} with embeddings "
                          f"{', '.join(json.dumps(e) for e in spec.subset_embeddings)} only")
    if t.precision not in spec.precisions:
        raise ConfigError(f"train.precision = \"{t.precision}\": {this} runs {' or '.join(spec.precisions)} only")
    if t.compression not in spec.compressions:
        others = [s.kind for s in registry.specs() if t.compression in s.compressions]
        raise ConfigError(f"train.compression = \"{t.compression}\": {this} runs "
                          f"{', '.join(json.dumps(c) for c in spec.compressions)} only ({spec.uncompressed_because}); "
                          f"\"{t.compression}\" runs on backend.kind = {', '.join(json.dumps(k) for k in others)}")
    e = b.embeddings
    if t.compression != "none" and e in spec.embeddings and e not in spec.compressed_embeddings:
        others = [s.kind for s in registry.specs() if t.compression in s.compressions and e in s.compressed_embeddings]
        raise ConfigError(f"train.compression = \"{t.compression}\" with backend.embeddings = \"{e}\": {this} "
                          f"compresses beside embeddings {', '.join(json.dumps(x) for x in spec.compressed_embeddings)} "
                          f"only ({spec.uncompressed_embeddings_because}); use backend.kind = "
                          f"{', '.join(json.dumps(k) for k in others) or 'none yet'} or train.compression = \"none\"")
    if b.embeddings not in spec.embeddings:
        others = [s.kind for s in registry.specs() if b.embeddings in s.embeddings]
        raise ConfigError(f"backend.embeddings = \"{b.embeddings}\": {this} runs "
                          f"{', '.join(json.dumps(e) for e in spec.embeddings)}; \"{b.embeddings}\" runs on "
                          f"backend.kind = {', '.join(json.dumps(k) for k in others) or 'none yet'}")
