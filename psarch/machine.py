"""Checks a config cannot make by itself: against this machine (a GPU, a text file) and a user's factory,
which must be importable. Made before any process starts."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psarch.errors import ConfigError, show

# A psarch.config.Config; named by its module only there, so that config can import this one.
if TYPE_CHECKING:
    from psarch.config import Config


def check_machine(cfg: Config, probed: dict[str, str | None] | None = None) -> Config:
    """Checks against this machine, made before any process starts: the device, the text file, and what an
    emulated cluster needs (root, iproute2, the htb, bfifo and u32 traffic control modules). `probed`: the
    emulation probe's answer kept for the caller's next configs (a sweep's points: 13 commands each otherwise).
    Not part of validate(): a config written for GPU ranks stays valid on a CPU-only machine that only
    loads it (a standalone parameter server, a test reading config.json)."""
    b, w = cfg.backend, cfg.workload
    if b.device == "cuda" or b.dist_backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            key, value = ("backend.device", "cuda") if b.device == "cuda" else ("backend.dist_backend", "nccl")
            raise ConfigError(f"{key} = \"{value}\": no CUDA device is visible on this machine; "
                              f"use backend.device = \"cpu\" (or \"auto\") and backend.dist_backend = \"gloo\" (or \"auto\")")
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.tensorboard = true: the tensorboard package is not installed; "
                          "pip install psarch[tensorboard]")
    if cfg.cluster.emulate:
        from psarch.cluster.preflight import missing
        answers = {} if probed is None else probed
        if "emulate" not in answers:
            answers["emulate"] = missing()
        if problem := answers["emulate"]:
            raise ConfigError(problem)
    if w.data == "text" and not w.factory:
        path = Path(w.text.path)
        if not path.is_file():
            raise ConfigError(f"workload.text.path = {show(w.text.path)}: no such file")
        size, need = path.stat().st_size, w.seq_len + 1  # a sequence and its next-token target
        if size < need:
            raise ConfigError(f"workload.text.path = {show(w.text.path)}: the file has {size} bytes; "
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
