"""A workload is what gets trained: a model, a loss, and a deterministic batch per step."""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from psarch import registry
from psarch.config import Config, ConfigError, resolve_factory
from psarch.data import ClickSource, MarkovSource, TextSource, clicks_hidden, shard_batch, step_generator
from psarch.data.clicks import share_floor
from psarch.models import DLRM, GPT, MLP
from psarch.models.dlrm import click_loss
from psarch.models.trainable import select_trainable


@dataclass
class Workload:
    """`batch(step, shard, num_shards)` returns shard `shard` of step `step`'s global batch; the global
    batch depends only on (seed, step), never on the number of shards."""

    model: nn.Module
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    batch: Callable[[int, int, int], Any]
    entropy_floor: float | None = None   # best achievable loss, where the data source knows it
    name: str = "custom"


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_workload(cfg: Config, device: str | None = None) -> Workload:
    """The workload a config names: a user's factory, or a built-in model on built-in data. `device` ("meta":
    shapes without memory) places a built-in model's parameters; data sources, and a factory, stay on CPU.
    The parameters train.trainable and train.lora_* leave out are frozen (psarch.models.trainable). A meta build
    builds its data source at its first batch, and knows no entropy floor (None)."""
    workload = _build(cfg, device)
    select_trainable(workload.model, cfg)
    return workload


_THEORY_MODELS: dict[str, nn.Module] = {}
THEORY_MODELS_KEPT = 32


def theory_model(cfg: Config) -> nn.Module:
    """The config's model on the meta device (names and shapes, no memory), built once per model for theory's
    reads (parameter counts, buckets, units) and shared by them: it is not to be changed. A factory's model is
    built at every call (its function may change under the same name)."""
    if cfg.workload.factory:
        return build_workload(cfg, device="meta").model
    t = cfg.train
    holds = registry.spec_of(cfg).worker_holds_tables(cfg) if cfg.workload.model == "dlrm" else None
    key = repr((cfg.workload, cfg.seed, t.trainable, t.lora_rank, t.lora_alpha, t.lora_targets, holds))
    if key not in _THEORY_MODELS:
        if len(_THEORY_MODELS) >= THEORY_MODELS_KEPT:
            _THEORY_MODELS.pop(next(iter(_THEORY_MODELS)))
        _THEORY_MODELS[key] = build_workload(cfg, device="meta").model
    return _THEORY_MODELS[key]


def theory_loss(cfg: Config) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """theory_model and a call that computes its loss once: a built-in model's on one sample on the meta device
    (shapes alone, no data drawn), a factory's on a rank's shard of its first batch, where the factory's model is.
    For theory's reads of what a forward does (psarch.model_units.forward_reach)."""
    if cfg.workload.factory:
        w = build_workload(cfg, device="meta")
        where = next((p.device for p in w.model.parameters()), torch.device("cpu"))
        sample = tree_map(lambda t: t.to(where) if torch.is_tensor(t) else t, w.batch(0, 0, cfg.backend.world_size))
        return w.model, lambda: w.loss_fn(w.model, sample)
    model, meta = theory_model(cfg), torch.device("meta")
    if cfg.workload.model == "dlrm":
        d = cfg.workload.dlrm
        clicks = (torch.empty(1, cfg.workload.clicks.dense, device=meta),
                  torch.empty(1, d.num_tables, d.bag, dtype=torch.long, device=meta), torch.empty(1, device=meta))
        return model, lambda: click_loss(model, clicks)
    tokens = torch.empty(1, cfg.workload.seq_len + 1, dtype=torch.long, device=meta)
    return model, lambda: next_token_loss(model, tokens)


def _build(cfg: Config, device: str | None) -> Workload:
    w = cfg.workload
    if w.factory:
        return _from_factory(cfg)   # it may make its data eagerly, which the meta device cannot hold
    if w.model == "dlrm":
        return _click_workload(cfg, device)

    @functools.cache   # built when first read: a meta build (shapes) reads none
    def source() -> MarkovSource | TextSource:
        return (MarkovSource(w.markov.vocab_size, w.markov.branching, cfg.seed, w.markov.concentration)
                if w.data == "markov" else TextSource(w.text.path))

    vocab = w.markov.vocab_size if w.data == "markov" else TextSource.vocab_size
    torch.manual_seed(cfg.seed)  # the same initial model on every rank and every backend
    with _on(device):
        if w.model == "gpt":
            g = w.gpt
            model: nn.Module = GPT(vocab, w.seq_len, g.n_layer, g.n_embd, g.n_head, g.mlp_ratio)
        else:
            m = w.mlp
            model = MLP(vocab, m.n_embd, m.hidden, m.n_layer)
    global_batch, length, seed = cfg.train.global_batch, w.seq_len + 1, cfg.seed

    def batch(step: int, shard: int, num_shards: int) -> torch.Tensor:
        return shard_batch(source().sample(global_batch, length, step_generator(seed, step)), shard, num_shards)

    floor = None if device == "meta" else source().entropy_rate
    return Workload(model, next_token_loss, batch, floor, f"{w.model}/{w.data}")


def _on(device: str | None) -> contextlib.AbstractContextManager:
    """Build on `device`; on the meta device without initialising (_NoInit)."""
    if device != "meta":
        return torch.device(device) if device else contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device("meta"))
    stack.enter_context(_NoInit())
    return stack


class _NoInit(TorchFunctionMode):
    """Skips filling meta tensors (torch.nn.init's functions, a tensor's in-place random draws and fills): a meta
    tensor has no values to fill, and torch's meta kernel for a draw imports torch._dynamo (1.7 s of CPU) at the
    first one."""

    FILLS = {getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")} | \
        {getattr(torch.Tensor, name) for name in ("normal_", "uniform_", "random_", "bernoulli_", "exponential_",
                                                  "geometric_", "cauchy_", "log_normal_", "zero_", "fill_")}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        tensor = args[0] if args else (kwargs or {}).get("tensor")
        if func in self.FILLS and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **(kwargs or {}))


def _click_workload(cfg: Config, device: str | None) -> Workload:
    """DLRM on synthetic clicks: the batch is (dense features, ids, clicks), each sharded by rows."""
    d, c, seed, global_batch = cfg.workload.dlrm, cfg.workload.clicks, cfg.seed, cfg.train.global_batch
    source = ClickSource(d.num_tables, d.rows, d.bag, c.dense, c.zipf, seed)
    model = click_model(cfg, device)

    def batch(step: int, shard: int, num_shards: int) -> tuple[torch.Tensor, ...]:
        return shard_batch(source.sample(global_batch, step_generator(seed, step)), shard, num_shards)

    return Workload(model, click_loss, batch, source.entropy_rate, "dlrm/clicks")


@contextlib.contextmanager
def shared_data(cfg: Config, folder: Path) -> Iterator[None]:
    """Within: the ranks a launcher starts map what its data source would make each of them build (the clicks
    source's hidden model, psarch/data/clicks_hidden.py, and its entropy floor), written once into `folder`."""
    w = cfg.workload
    if w.factory or w.model != "dlrm" or cfg.backend.world_size == 1:
        yield
        return
    d = w.dlrm
    with clicks_hidden.shared(folder, d.num_tables, d.rows, w.clicks.dense, cfg.seed):
        share_floor(d.num_tables, d.rows, d.bag, w.clicks.dense, w.clicks.zipf, cfg.seed)
        yield


def click_model(cfg: Config, device: str | None = None) -> DLRM:
    """The run's initial DLRM, without its data source (a row server needs no batches). Seeds torch's global
    generator. Where the backend says a worker does not hold the tables (BackendSpec.worker_holds_tables:
    a PS worker with rows, whose servers build them; a sharded ddp rank, which builds only its own rows),
    they stay on the meta device."""
    d, c = cfg.workload.dlrm, cfg.workload.clicks
    tables = registry.spec_of(cfg).worker_holds_tables(cfg)
    torch.manual_seed(cfg.seed)   # the dense layers; the tables draw from their own generators (models/dlrm.py)
    with _on(device):
        return DLRM(c.dense, d.num_tables, d.rows, d.dim, d.bottom_mlp, d.top_mlp, d.interaction, cfg.seed, tables)


def _from_factory(cfg: Config) -> Workload:
    spec = cfg.workload.factory
    fn = resolve_factory(spec)
    torch.manual_seed(cfg.seed)
    wl = fn(cfg) if _takes_config(fn) else fn()
    if not isinstance(wl, Workload):
        raise ConfigError(f"workload.factory = \"{spec}\": returned {type(wl).__name__}, expected psarch.Workload")
    return wl


def _takes_config(fn: Callable) -> bool:
    """Whether fn has a positional parameter for the config (`def make(cfg)`, `def make(*args)`); a factory
    with keyword-only parameters or **kwargs (`def make(**options)`) is called with none."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it as it is
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
