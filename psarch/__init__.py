"""psarch: one workload under a parameter server, collective DDP and ZeRO, measured side by side."""
from psarch.config import Config, ConfigError, load_config
from psarch.trainer import MemoryReport, StepStats, Trainer, TrafficReport
from psarch.workload import Workload

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
