"""psarch: one workload under a parameter server, collective DDP and ZeRO, measured side by side.

Where things live. Dependencies point one way (zero -> collective -> psarch core, psarch.ps -> core) and the core
names no backend; bench/ and the studies' tables in report/ sit above the backends they compare.

    config/       the Config schema (config/schema.py) and loading (`psarch.config`), how an option is declared
                  (config/fields.py: `option`, `section`), [backend]'s core options and the groups backends
                  include (config/backend.py), the [faults] section (config/faults.py), which options a run
                  reads, TOML files and --set, checks across keys
    launch/       `psarch run`: ranks started (ranks.py), one rank's step loop (runner.py), supervision,
                  [faults] struck and worlds restarted (faults.py), each world's launch and first step (worlds.py),
                  what a restart cost (failure_cost.py), sweeps, the run folder written (outputs.py),
                  local ranks for tests (spawn.py)
    report/       what a user reads: `psarch compare` and its plots, a run folder read back (runs.py), and
                  the studies' tables, `psarch report crossover | cluster | stragglers | pipeline`; a run's traced
                  step beside the simulator's, `psarch report timeline` (the Chrome trace format: trace.py)
    theory/       the shared algebra every prediction uses (`psarch.theory.predict`, memory, ring passes, an
                  emulated run's step: cluster_step); the step simulator: a step as a program (theory/program.py:
                  compute spans, transfers, the cluster; each backend writes its own, BackendSpec.program),
                  played by theory/simulate.py (max-min fair links, a connection's transfers in turn, α per
                  message; a reduced program for N = 1,024) and in steady state by theory/steady.py; the
                  estimator of `psarch estimate` (theory/estimate.py, its step times theory/estimate_steps.py)
                  and its command (theory/cli.py); the steps a failure loses to its checkpoint (failures.py)
    bench/        benchmarks against PyTorch's own peers, `psarch bench NAME` (step, allreduce, ddp, zero,
                  zero-stages, ps, pipeline, tensor); `python -m psarch.bench_step` is `psarch bench step`
    cluster/      the emulated cluster: placement, network namespaces and shaped links (emulated.py,
                  netns.py), the virtual device (cluster/device.py, paced by pacing.py; by default this
                  machine's core measured alone, core.py), stragglers, dilation (D and the stretched timeouts)
    checkpoint/   checkpoints any backend writes in parallel and any backend reads at any world size;
                  finetune.py: a LoRA/frozen config --from a base model's checkpoint (the PS's and the hybrid's
                  servers build what they hold from it too)
    models/, data/  built-in models (gpt, mlp, dlrm) and data (markov, text, clicks)
    ps/           the parameter-server backend: server/ (parameter_server.py's handler table; a push is
                  handled in server/pushes.py, applied in server/updates.py; GEO's compressed pulls:
                  server/deltas.py), worker/ (top-k pushes: topk.py), sparse.py (what compressed traffic carries,
                  alike on both ends), messages.py (what a config implies for the messages), wire.py, its spec
                  and theory, partitions.py (which server holds what, no torch) and program.py (its step as a
                  program for the simulator)
    backend.py, registry.py   BackendSpec, how a backend declares itself, and the registered backends
    trainer.py, workload.py   the Trainer contract (and consolidated_state, the fp32 model it hands back),
                  the Workload (model, loss, batch of a step)
    dist.py, flat.py, optim.py, precision.py, meters.py, timeline.py, activations.py, embeddings.py, model_units.py
                  what backends share: the rank's context, flat buffers, optimizers, mixed precision,
                  meters of bytes and memory, the recorder of a traced step's spans, a block's activation
                  memory by formula, embedding treatments, a model's units (ZeRO-3's and the pipeline's)
    single.py, single_spec.py  the single-process backend, the reference every backend is checked against
    dp/           `dp`, one process with one thread per device (torch.nn.DataParallel's step, written out), and
                  `torch_dp`, DataParallel itself
    records.py, errors.py, machine.py, throughput.py, units.py, zipf.py, cli.py
                  records between processes, errors (ConfigError included), machine checks, samples/s,
                  byte formatting, Zipf ids; the `psarch` command

The other backends are packages beside this one: collective/ (communicators: the hand-written ring,
collective/ring.py, beside ring_plain.py and torch's native; DDP and its gradient compression, compression.py;
its embedding treatments, embeddings.py, among them the hybrid, ps_tables.py: the tables on psarch.ps's servers,
the one place collective uses psarch.ps; pipeline/; tensor/; program.py, ring passes and DDP's step as a
program) and zero/ (ZeRO 1-3, the hybrid's tables too; program.py, their steps as programs).

Nothing is imported here until used: `psarch keys`, `--help` and a config error answer without torch.
"""
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psarch.records import Summary

# names are imported when first used: `psarch keys`, `--help` and a config error answer without importing torch
# (seconds on a quiet machine)
_LAZY = {"Config": "psarch.config", "ConfigError": "psarch.errors", "load_config": "psarch.config",
         "MemoryReport": "psarch.trainer", "StepStats": "psarch.trainer", "Trainer": "psarch.trainer",
         "TrafficReport": "psarch.trainer", "Workload": "psarch.workload"}

__all__ = ["Config", "ConfigError", "load_config", "run", "Workload", "Trainer", "StepStats",
           "MemoryReport", "TrafficReport"]
__version__ = "0.1.0"


def run(config, out=None, overrides=None, echo: bool = True) -> "Summary":
    """Run an experiment (a Config, or a path to a TOML file) and return its summary."""
    from psarch.config import Config, apply_overrides, check_applies, explicit_keys, from_dict, load_config
    from psarch.launch.ranks import run as _run

    cfg = config if isinstance(config, Config) else load_config(config, overrides)
    if overrides and isinstance(config, Config):
        # the config's own options of a backend an override leaves are left out; an override must apply
        data = apply_overrides(config.to_dict(), overrides)
        cfg = from_dict(data, config.name, others=True)
        check_applies(cfg, explicit_keys({}, overrides), data)
    return _run(cfg, out, echo)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'psarch' has no attribute {name!r}")
