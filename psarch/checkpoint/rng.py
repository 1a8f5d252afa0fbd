"""The random generators a checkpoint carries, one state per rank: torch's CPU generator and, on a GPU rank,
its CUDA generator (dropout draws from them). Data needs none: a batch is a function of (seed, step).

States are kept as base64 text in the checkpoint's JSON metadata, so nothing is unpickled to restore them."""
from __future__ import annotations

import base64

import torch


def capture(device: torch.device) -> dict[str, str]:
    """This rank's generator states: "cpu", and "cuda" where the rank computes on a GPU."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return {k: base64.b64encode(v.numpy().tobytes()).decode("ascii") for k, v in state.items()}


def restore(state: dict[str, str], device: torch.device) -> None:
    """Set this rank's generators to a captured `state` (a CUDA state only where both sides ran on a GPU);
    a malformed state raises ValueError saying what was wrong."""
    try:
        tensors = {k: torch.frombuffer(bytearray(base64.b64decode(v, validate=True)), dtype=torch.uint8)
                   for k, v in state.items()}
        torch.set_rng_state(tensors["cpu"])
        if device.type == "cuda" and "cuda" in tensors:
            torch.cuda.set_rng_state(tensors["cuda"], device)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"generator state {sorted(state)} cannot be restored ({e})") from None
