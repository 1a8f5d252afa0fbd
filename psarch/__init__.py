"""psarch: one workload under a parameter server, collective DDP and ZeRO, measured side by side."""
from psarch.config import Config, ConfigError, load_config

# torch-backed names are imported when first used: `psarch keys`, `--help` and a config error answer without
# importing torch (seconds on a quiet machine)
_LAZY = {"MemoryReport": "psarch.trainer", "StepStats": "psarch.trainer", "Trainer": "psarch.trainer",
         "TrafficReport": "psarch.trainer", "Workload": "psarch.workload"}

__all__ = ["Config", "ConfigError", "load_config", "run", "Workload", "Trainer", "StepStats",
           "MemoryReport", "TrafficReport"]
__version__ = "0.1.0"


def run(config, out=None, overrides=None, echo: bool = True) -> dict:
    """Run an experiment (a Config, or a path to a TOML file) and return its summary."""
    from psarch.launch import run as _run

    cfg = config if isinstance(config, Config) else load_config(config, overrides)
    if overrides and isinstance(config, Config):
        from psarch.config import apply_overrides, from_dict
        cfg = from_dict(apply_overrides(config.to_dict(), overrides), config.name)
    return _run(cfg, out, echo)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'psarch' has no attribute {name!r}")
