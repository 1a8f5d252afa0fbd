"""Where a run starts: `--resume RUN_DIR` (its latest complete checkpoint, or the one --checkpoint names) or
`--from CHECKPOINT_DIR` (a fork), checked before any rank starts: files against the metadata, parameters
against the config's model, and, for a resume, the config against the one the checkpoint was written under.

`--resume` continues the same run: only the options in RESUMABLE may differ from the checkpoint's config
(they change how long the run goes on and what it prints or keeps, never what a step computes or how it
is measured). Anything else is refused in one line that points to `--from`, which starts a new run."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from psarch import registry
from psarch.checkpoint.finetune import is_base_start
from psarch.checkpoint.reader import Checkpoint, CheckpointError, latest_complete
from psarch.checkpoint.writer import METADATA, complete_checkpoints
from psarch.cluster import device
from psarch.config import REPORT_ONLY
from psarch.config import Config, ConfigError, applies, field_of

CHECKPOINTS = "checkpoints"     # the folder under a run folder that holds its checkpoints
FORKED_FROM = "forked_from"     # where a fork keeps the checkpoint of its own run folder that it starts from
# cluster.dilation is how slowly the emulation runs, not the cluster it stands for (every time reported is the
# cluster's); "auto" is picked again at every launch, and the ranks' checkpoints hold the number it gave, and
# every backend timeout stretched by it (any `backend.*timeout_s` may change: a wait changes no result)
RESUMABLE = ("name", "label", "out", "train.steps", "train.log_every", "train.checkpoint_every",
             "train.keep_checkpoints", "train.tensorboard", "backend.timeout_s", "cluster.dilation",
             # the faults still to strike: a world restarted by faults.restart carries only those
             "faults.kill", "faults.pause", "faults.restart", *REPORT_ONLY)
# this machine's core (cluster.device = "cpu-core", the emulated default) is measured again at every launch, as
# D is; the ranks' checkpoints hold the device's name and the rate it measured
MEASURED_CORE = ("cluster.device", "cluster.device_tflops")


def resolve_start(cfg: Config, run_dir: Path, resume: bool, start: str | Path | None, pick: str | None = None,
                  echo: bool = True, first: bool = True, move: bool = True, shrinks: bool = False
                  ) -> tuple[Config, Path | None]:
    """Where a run starts, decided here alone: the config it records (a fork's started_from; a resume keeps the
    one its checkpoint holds) and the verified checkpoint folder its state is read from (None: step 0).

    The run folder is tidied by the first rank (`first`): a resume removes unfinished checkpoint folders and,
    from an earlier checkpoint (--checkpoint), the later ones; a fork keeps a source that lies in the folder it
    replaces (moved aside where `move`; under torchrun every rank reads it in place). `shrinks`: a world restarted
    at fewer ranks (faults.restart = "shrink") resumes the run at its smaller backend.world_size."""
    ckpt = starting_checkpoint(cfg, run_dir, resume, start, pick, shrinks)   # verified before anything is written
    if resume:
        assert ckpt is not None, "starting_checkpoint finds a --resume's checkpoint or raises"
        if first:
            drop_unfinished(run_dir)
        dropped = drop_after(run_dir, ckpt.step) if pick is not None and first else []
        if dropped and echo:
            print(f"psarch: resuming from {ckpt.path.name}: removed the later checkpoints {', '.join(dropped)}",
                  flush=True)
        ckpt.close()
        return dataclasses.replace(cfg, started_from=ckpt.config.get("started_from", {})), ckpt.path
    if ckpt is not None:
        _refuse_fork_of_fine_tune_from_base(cfg, ckpt)
    path = keep_fork_source(ckpt, run_dir, move)
    if ckpt is None:
        return cfg, None
    assert path is not None, "keep_fork_source returns where a given checkpoint lies"
    ckpt.close()
    return dataclasses.replace(cfg, started_from=provenance(ckpt, path)), path


def starting_checkpoint(cfg: Config, run_dir: Path, resume: bool, start: str | Path | None,
                        pick: str | None = None, shrinks: bool = False) -> Checkpoint | None:
    """The verified checkpoint a run starts from, or None for a run from step 0. `pick` (--checkpoint): with
    `resume`, which checkpoint of the run (a step_* folder name or a step number) instead of the latest.
    Raises ConfigError (one line, naming the flag) when --resume, --checkpoint or --from names no run or
    checkpoint, or a resume would change what the run measures; CheckpointError when the checkpoint is
    incomplete, corrupted, or does not fit the config."""
    if resume and start is not None:
        raise CheckpointError("--resume and --from exclude each other: resume a run, or fork a checkpoint")
    if pick is not None and not resume:
        raise CheckpointError(f"--checkpoint {pick}: applies to --resume only (--from names a checkpoint folder)")
    if resume:
        start = _resumed(run_dir, pick)
    if start is None:
        return None
    if not resume and not (Path(start) / METADATA).is_file():   # a wrong path, named as the flag that gave it
        raise ConfigError(f"--from {start}: " + ("not a checkpoint folder (no metadata.json; a run's checkpoints "
                                                 "are its checkpoints/step_* folders)" if Path(start).is_dir()
                                                 else "no such folder"))
    try:
        ckpt = Checkpoint(start)
    except CheckpointError as e:   # its metadata.json is damaged
        raise _offer(e, run_dir, int(Path(start).name[5:])) if resume else e from None
    try:
        if resume:
            check_resumable(cfg, ckpt, run_dir, shrinks)
        try:
            ckpt.verify()
        except CheckpointError as e:
            raise _offer(e, run_dir, ckpt.step) if resume else e from None
        if not resume and is_base_start(cfg, ckpt, _meta_model(cfg)):   # fine-tuning: step 0, optimizer fresh
            return ckpt
        ckpt.check_model(model_shapes(cfg))
        ckpt.check_optimizer(cfg.train.optimizer)
        if ckpt.step >= cfg.train.steps:
            raise CheckpointError(f"train.steps = {cfg.train.steps}: the checkpoint {ckpt.path} is at step "
                                  f"{ckpt.step}, nothing is left to run (raise train.steps)")
    except BaseException:   # refused: its files are closed here, as the caller never gets it
        ckpt.close()
        raise
    return ckpt


def _resumed(run_dir: Path, pick: str | None) -> Path:
    """The checkpoint a --resume continues from: the latest complete one, or the one --checkpoint names."""
    root = run_dir / CHECKPOINTS
    if not run_dir.is_dir():
        raise ConfigError(f"--resume {run_dir}: no such run folder")
    if pick is None:
        found = latest_complete(root)
        if found is None:
            raise ConfigError(f"--resume {run_dir}: no complete checkpoint under {root} (a run writes them with "
                              f"train.checkpoint_every)")
        return found
    done = {p.name: p for p in complete_checkpoints(root)}
    name = f"step_{int(pick):06d}" if pick.isdigit() else pick
    if name not in done:
        raise ConfigError(f"--checkpoint {pick}: no complete checkpoint {name} under {root}; there are "
                              f"{', '.join(done) or 'none'}")
    return done[name]


def _offer(error: CheckpointError, run_dir: Path, step: int) -> CheckpointError:
    """A resume's damaged checkpoint: the error, and the newest earlier checkpoint of the run that is intact, as
    the command that resumes from it."""
    for path in reversed(complete_checkpoints(run_dir / CHECKPOINTS)):
        if int(path.name[5:]) >= step:
            continue
        if not _intact(path):
            continue
        return CheckpointError(f"{error}; the newest intact checkpoint is {path.name}: --resume {run_dir} "
                               f"--checkpoint {path.name} continues from it (its later checkpoints are removed)")
    return CheckpointError(f"{error}; no earlier checkpoint of the run is intact")


def _intact(path: Path) -> bool:
    """Whether the checkpoint at `path` reads back whole (its files closed again)."""
    try:
        ckpt = Checkpoint(path)
    except CheckpointError:
        return False
    try:
        ckpt.verify()
        return True
    except CheckpointError:
        return False
    finally:
        ckpt.close()


def check_resumable(cfg: Config, ckpt: Checkpoint, run_dir: Path, shrinks: bool = False) -> None:
    """A resume continues the run the checkpoint belongs to: its config may differ only in RESUMABLE options (and,
    where the world `shrinks`, in backend.world_size), and every worker must have written its part (a PS worker
    lost before the checkpoint left none)."""
    changed = [c for c in changed_keys(ckpt.config, cfg) if not (shrinks and c[0] == "backend.world_size")]
    if changed:
        key, old, new = changed[0]
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise ConfigError(f"--resume {run_dir}: {key} = {json.dumps(new, default=str)} here, "
                          f"{json.dumps(old, default=str)} in the run's checkpoint {ckpt.path.name}{more}; a resume "
                          f"continues the same run, so only {', '.join(RESUMABLE)} may change. To train on from that "
                          f"state under this config, start a new run: --from {ckpt.path}")
    wrote = {name.removesuffix(".bin") for name in ckpt.meta["files"]}
    missing = [r for r in range(registry.spec_of(cfg).processes(cfg)) if f"rank{r}" not in wrote]   # a part each
    if missing:
        raise ConfigError(f"--resume {run_dir}: the checkpoint {ckpt.path.name} holds no part of worker "
                          f"{', '.join(map(str, missing))} (lost before it was written); resuming would bring "
                          f"it back from the servers' model, which the run never did. Start a new run that "
                          f"does: --from {ckpt.path}")


def changed_keys(stored: dict[str, Any], cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, this config's value) for every option a resume may not change that differs;
    options the run does not read are left out, and an option the checkpoint predates counts as its default."""
    now = _flat(json.loads(json.dumps(cfg.to_dict())))   # as the checkpoint stored its config: through JSON
    old = _flat(stored)
    remeasured = device.chosen(cfg) == device.CORE and cfg.cluster.device_tflops == 0 and \
        old.get("cluster.device") == device.CORE
    out = []
    for key, value in now.items():
        if key in RESUMABLE or key.split(".")[0] == "started_from" or not applies(key, cfg) or \
                (key.startswith("backend.") and key.endswith("timeout_s")) or (remeasured and key in MEASURED_CORE):
            continue
        before = old[key] if key in old else json.loads(json.dumps(_default(key)))
        if before != value:
            out.append((key, before, value))
    return out


def _default(key: str) -> Any:
    f = field_of(key)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is dataclasses.MISSING:
        raise TypeError(f"config field {key!r} has neither a default nor a default_factory")
    return f.default_factory()


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _refuse_fork_of_fine_tune_from_base(cfg: Config, ckpt: Checkpoint) -> None:
    """--from a checkpoint of a fine-tune that started from a base model's checkpoint: it holds only what trains,
    and a fork records the fine-tune's checkpoint, not the base, as where it started, so its frozen weights would be
    drawn from the seed, not the base's: refused (a --resume of that run finds its base again)."""
    train = ckpt.config.get("train", {})
    if (train.get("lora_rank") or train.get("trainable")) and ckpt.config.get("started_from", {}).get("path") \
            and (cfg.train.lora_rank or cfg.train.trainable):
        raise ConfigError(f"--from {ckpt.path}: a checkpoint of a fine-tune started from a base model's checkpoint "
                          f"({ckpt.config['started_from']['path']}) holds only what trains, so a fork would draw the "
                          f"frozen weights from the seed; --resume that run, or start --from the base checkpoint")


def provenance(ckpt: Checkpoint, path: Path) -> dict[str, Any]:
    """What a fork records of the checkpoint it started from (config.json's and summary.json's started_from):
    the folder it lies in now, its step, and the sha256 of the config it was written under (JSON, keys sorted)."""
    text = json.dumps(ckpt.config, sort_keys=True)
    return {"path": str(path), "step": ckpt.step, "config_sha256": hashlib.sha256(text.encode()).hexdigest()}


def keep_fork_source(ckpt: Checkpoint | None, run_dir: Path, move: bool = True) -> Path | None:
    """A new run replaces its run folder, checkpoints included (a later --resume must never pick an earlier
    run's). A fork from a checkpoint of that very folder keeps it, moved to <run>/forked_from/, out of
    --resume's reach (`move` False, as under torchrun where every rank reads it: refused instead); an earlier
    fork's kept source is removed unless this run starts from it. Returns where the checkpoint lies now."""
    kept = run_dir / FORKED_FROM
    if ckpt is not None:
        path = ckpt.path.resolve()
        if kept.resolve() in path.parents:
            return ckpt.path
        if (run_dir / CHECKPOINTS).resolve() in path.parents:
            if not move:
                raise CheckpointError(f"--from {ckpt.path}: it lies under the run folder {run_dir}, which the fork "
                                      f"replaces; use --resume {run_dir}, or another --out")
            shutil.rmtree(kept, ignore_errors=True)
            kept.mkdir(parents=True)
            ckpt.close()
            return Path(shutil.move(str(ckpt.path), str(kept / ckpt.path.name)))
    shutil.rmtree(kept, ignore_errors=True)
    return ckpt.path if ckpt is not None else None


def drop_after(run_dir: Path, step: int) -> list[str]:
    """Remove the run's checkpoints after `step` (a resume from an earlier one writes its own); their names."""
    later = [p for p in complete_checkpoints(run_dir / CHECKPOINTS) if int(p.name[5:]) > step]
    for p in later:
        shutil.rmtree(p)
    return [p.name for p in later]


def drop_unfinished(run_dir: Path) -> list[str]:
    """Remove the unfinished checkpoint folders (.tmp_step_*) a kill mid-write left in the run: a resumed PS run
    merges the worker parts it finds in the folder, and a lost worker's part from the killed attempt must not be
    among them. Their names."""
    left = sorted(p for p in (run_dir / CHECKPOINTS).glob(".tmp_step_*") if p.is_dir())
    for p in left:
        shutil.rmtree(p)
    return [p.name for p in left]


def model_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The config's trainable parameters (name -> shape); a built-in model is made on the meta device (no
    memory), its data sources on CPU (they compute with numpy, which meta tensors cannot feed)."""
    return {n: tuple(p.shape) for n, p in _meta_model(cfg).named_parameters() if p.requires_grad}


def _meta_model(cfg: Config) -> torch.nn.Module:
    """The config's model (adapters added, frozen parameters marked) on the meta device."""
    from psarch.workload import build_workload

    return build_workload(cfg, device="meta").model
