"""Where a run starts: `--resume RUN_DIR` (its latest complete checkpoint) or `--from CHECKPOINT_DIR` (a fork),
checked before any rank starts: files against the metadata, parameters against the config's model."""
from __future__ import annotations

from pathlib import Path


from psarch.checkpoint.reader import Checkpoint, CheckpointError, latest_complete
from psarch.config import Config

CHECKPOINTS = "checkpoints"   # the folder under a run folder that holds its checkpoints


def starting_checkpoint(cfg: Config, run_dir: Path, resume: bool, start: str | Path | None) -> Checkpoint | None:
    """The verified checkpoint a run starts from, or None for a run from step 0. Raises CheckpointError
    (one line) when it is missing, incomplete, corrupted, or does not fit the config."""
    if resume and start is not None:
        raise CheckpointError("--resume and --from exclude each other: resume a run, or fork a checkpoint")
    if resume:
        found = latest_complete(run_dir / CHECKPOINTS)
        if found is None:
            raise CheckpointError(f"--resume {run_dir}: no complete checkpoint under {run_dir / CHECKPOINTS}")
        start = found
    if start is None:
        return None
    if not resume and (run_dir / CHECKPOINTS).resolve() in Path(start).resolve().parents:
        # a fork starts its run folder afresh, checkpoints included: it would delete what it starts from
        raise CheckpointError(f"--from {start}: it lies under the run folder {run_dir}, which the fork replaces; "
                              f"use --resume {run_dir}, or another --out")
    ckpt = Checkpoint(start)
    ckpt.verify()
    ckpt.check_model(model_shapes(cfg))
    ckpt.check_optimizer(cfg.train.optimizer)
    if ckpt.step >= cfg.train.steps:
        raise CheckpointError(f"train.steps = {cfg.train.steps}: the checkpoint {ckpt.path} is at step {ckpt.step}, "
                              f"nothing is left to run (raise train.steps)")
    return ckpt


def model_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The config's trainable parameters (name -> shape); a built-in model is made on the meta device (no
    memory), its data sources on CPU (they compute with numpy, which meta tensors cannot feed)."""
    from psarch.workload import build_workload

    model = build_workload(cfg, device="meta").model
    return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
