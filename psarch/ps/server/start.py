"""A server of a run, built from the config as every worker builds its model: its range of the initial
parameters and, with embedding rows, its shard of the initial tables (computed a block at a time, never whole).
Used by the launcher's servers (psarch/ps/services.py) and by `psarch server` (psarch/ps/standalone.py)."""
from __future__ import annotations

from typing import Any

from psarch.checkpoint.finetune import base_checkpoint
from psarch.config import Config
from psarch.ps.layout import SEED_LOCK, initial_flat, meta_model
from psarch.ps.rows import dense_flat, server_config
from psarch.ps.server.parameter_server import ParameterServer
from psarch.ps.server.row_shard import initial_shard


def build_server(index: int, cfg: Config, host: str, port: int, build: bool = True, **kwargs: Any) -> ParameterServer:
    """Server `index`, holding its part of the initial model (build=False, dense only: a server that waits for
    an `init`, for benchmarks); kwargs go to ParameterServer. A collective backend's config (the hybrid,
    backend.embeddings = "ps"): a server of the tables' rows alone."""
    if cfg.backend.kind != "ps":
        return table_server(index, cfg, host, port, **kwargs)
    if cfg.backend.embeddings == "rows":
        return row_server(index, cfg, host, port, **kwargs)
    flat = initial_flat(cfg) if build else None
    server = ParameterServer(index, cfg, host, port, numel=flat.numel() if flat is not None else None, **kwargs)
    if flat is not None:
        server.initialize(flat)
    return server


def row_server(index: int, cfg: Config, host: str, port: int, **kwargs: Any) -> ParameterServer:
    """A server with embedding rows holding its part of the initial model: its dense range and its rows."""
    from psarch.workload import click_model
    if cfg.train.precision != "fp32":
        raise ValueError(f"train.precision = {cfg.train.precision!r}: embedding rows run in fp32 only")
    with SEED_LOCK:  # click_model seeds torch's global generator: servers run as threads take turns
        dense = dense_flat(click_model(cfg))   # its tables stay on meta: the shard is built alone, below
    # a rowpush may carry up to every row of the tables: cap frames at a whole chunk, not the dense range
    server = ParameterServer(index, cfg, host, port, numel=None, **kwargs)
    assert server.rows is not None   # a server of a run with embeddings = "rows"
    server.initialize(dense, initial_shard(cfg, server.rows.space, index))
    return server


def table_server(index: int, cfg: Config, host: str, port: int, **kwargs: Any) -> ParameterServer:
    """The hybrid's server (collective/ps_tables.py): its shard of the initial tables (a fine-tune's: of the base
    checkpoint it started from), no dense range; it runs as a sync PS server with rows (psarch/ps/server/rows.py,
    tables_only) of the config the servers read."""
    ps_cfg = server_config(cfg)
    server = ParameterServer(index, ps_cfg, host, port, numel=None, tables_only=True, **kwargs)
    assert server.rows is not None
    server.rows.start(initial_shard(ps_cfg, server.rows.space, index))
    base = base_checkpoint(cfg, meta_model(cfg))
    if base is not None:
        try:
            server.rows.load_base(base)
        finally:
            base.close()
    return server
