"""GEO-SGD's worker side (as in PaddlePaddle's GEO): a local optimizer steps the worker's own fp32 master every
step; every k_steps the worker pushes (local − last synced) / N and continues from the servers' model, which
it keeps as the new `synced` (with train.compression: from `synced` plus the compressed change the servers sent,
psarch/ps/server/deltas.py)."""
from __future__ import annotations


import torch

from psarch.checkpoint import Checkpoint
from psarch.checkpoint.fragments import fragments_in, load_scaler, restore
from psarch.config import Config
from psarch.flat import FlatParams
from psarch.ps.layout import Layout
from psarch.meters import tensor_bytes
from psarch.precision import MixedPrecisionOptimizer
from psarch.ps.snapshot import GeoRecord, WorkerRecord


class GeoLocal:
    """A GEO worker's local optimizer over its flat parameters, and the model it last pulled."""

    def __init__(self, flat: FlatParams, cfg: Config) -> None:
        self.flat = flat
        self.optim = MixedPrecisionOptimizer([flat.data], cfg.train, cfg.train.precision)
        self.synced = self.optim.master.masters[0].detach().float().clone()   # the last pulled model

    def delta(self, workers: int, dtype: torch.dtype) -> torch.Tensor:
        """What a sync pushes: (local − last synced) / N, in the wire's dtype."""
        return ((self.optim.master.masters[0].detach() - self.synced) / workers).to(dtype)

    def pulled(self, deltas: bool = False) -> None:
        """The flat buffer now holds the servers' model (deltas: the pulled deltas were added to `synced`, which
        is now the model to go on from): continue from it."""
        master = self.optim.master.masters[0].detach()
        with torch.no_grad():
            if deltas:
                master.copy_(self.synced)
                self.optim.master.copy_to_model()   # (fp32: the master is the flat buffer)
                return
            if self.optim.master.copies:
                master.copy_(self.flat.data)   # pulled in the compute dtype
            self.synced.copy_(master)

    def memory(self) -> tuple[int, int]:
        """(optimizer bytes, fp32 master copies included; bytes of the synced copy)."""
        return self.optim.state_bytes(), tensor_bytes([self.synced])

    # ------------------------------------------------------------------ checkpoints

    def _state(self) -> dict[str, torch.Tensor | float]:   # a torch optimizer's state of one parameter
        return self.optim.optimizer.state.get(self.optim.master.params[0], {})

    def tensors(self, own: str) -> dict[str, torch.Tensor]:
        """A checkpoint's flat tensors of this worker (keys under `own`): master, synced, optimizer state."""
        state = self._state()
        return {own + "master": self.optim.master.params[0], own + "synced": self.synced,
                **{own + k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}}

    def record(self) -> GeoRecord:
        """What a checkpoint's record holds of it: the optimizer state's keys and scalars, the loss scaler."""
        state = self._state()
        return {"local_keys": [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0],
                "local_scalars": {k: float(v) for k, v in state.items() if not torch.is_tensor(v) or v.dim() == 0},
                "scaler": self.optim.scaler.state_dict()}

    def restore_record(self, own: str, rec: WorkerRecord) -> dict[str, torch.Tensor]:
        """Rebuild the optimizer state from this worker's own record; the tensors to fill from the checkpoint."""
        master = self.optim.master.params[0]
        state = self.optim.optimizer.state[master]
        state.clear()
        for k in rec["local_keys"]:
            state[k] = torch.zeros_like(master, memory_format=torch.contiguous_format)
        group = self.optim.optimizer.param_groups[0]   # where torch keeps a step count, as restore() does
        device = master.device if group.get("fused") or group.get("capturable") else "cpu"
        for k, v in rec["local_scalars"].items():
            state[k] = torch.tensor(v, dtype=torch.float32, device=device)
        self.optim.scaler.load_state_dict(rec["scaler"])
        return {own + "master": master, own + "synced": self.synced, **{own + k: state[k] for k in rec["local_keys"]}}

    def restore_fork(self, ckpt: Checkpoint, layout: Layout) -> None:
        """A fork (another run's checkpoint): the local optimizer starts from the checkpoint's state, the model
        from the servers' (just pulled)."""
        master = self.optim.master.params[0]
        restore(self.optim.optimizer, [master], ckpt,
                lambda: fragments_in(self.optim.optimizer, [master], 0, layout, 0, self.flat.numel))
        load_scaler(self.optim.scaler, ckpt)
        self.optim.master.copy_to_model()
        self.synced.copy_(master.detach())
