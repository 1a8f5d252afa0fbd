"""Checkpoints every backend writes in parallel and any backend reads at any world size.

A checkpoint is a folder `step_000K/` holding one raw binary file per writing rank and `metadata.json`,
which lists every *fragment*: elements [offset, offset + numel) of one flattened parameter, for its fp32
master value ("param") or one optimizer state tensor (exp_avg, momentum_buffer, ...), with the file and
byte position they lie at, plus each file's size and sha256, the step, the config, the loss scaler and each
rank's random generator states (psarch.checkpoint.rng; data needs none: a batch is a function of (seed, step)).
A trainer says which fragments it holds by parameter name and offset (psarch.checkpoint.fragments), so a
rank loading at another world size or layout reads just the stored fragments that overlap its own.
Nothing here is read with pickle: data files are raw little-endian tensors, the index is JSON.
"""
from psarch.checkpoint.fragments import Fragment, Pieces
from psarch.checkpoint.reader import Checkpoint, CheckpointError, consolidated_state_dict, latest_complete
from psarch.checkpoint.writer import save

__all__ = ["Checkpoint", "CheckpointError", "Fragment", "Pieces", "consolidated_state_dict", "latest_complete",
           "save"]
