"""Row-wise optimizers: a server's update of the embedding rows a step touched, the others left alone.

Each updates `table[idx]` (idx: distinct local row indices) from the rows' fp32 gradients `grad` (one
row per index), with the hyper-parameters of `[train]` as torch's optimizers read them:

- SGD:     p -= lr·(g + wd·p)
- Adagrad: g += wd·p;  acc += g²;  p -= lr·g / (sqrt(acc) + eps)      (acc starts at initial_accumulator_value)
- AdamW, lazy: per row t += 1;  p *= 1 − lr·wd;  m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²;
           p -= lr/(1−β1^t) · m / (sqrt(v)/sqrt(1−β2^t) + eps)    (t, m, v of untouched rows stay as they are)

Which equal the dense update of the whole table: SGD without momentum or weight decay, and Adagrad without
weight decay. An untouched row's dense gradient is exactly zero, and then neither moves it (Adagrad adds
0² to its accumulator). Weight decay is applied here to touched rows only (dense decays every row each
step), momentum would keep moving untouched rows (refused by the config), and dense AdamW moves every row
whose moments are non-zero and advances one step count for all: lazy AdamW is a different optimizer,
the one sparse trainers use (torch.optim.SparseAdam, TensorFlow's LazyAdam).
"""
from __future__ import annotations

import torch

from psarch.config import TrainConfig


class RowOptimizer:
    """Updates rows of one fp32 table (rows, dim) in place."""

    def __init__(self, table: torch.Tensor, t: TrainConfig) -> None:
        if t.optimizer == "sgd" and (t.momentum or t.nesterov):
            raise ValueError(f"train.momentum = {t.momentum:g}: row-wise SGD on the parameter server has no "
                             f"momentum (it would move untouched rows); use momentum = 0 or optimizer = \"adagrad\"")
        self.table, self.t = table, t
        self.state: dict[str, torch.Tensor] = {}
        if t.optimizer == "adagrad":
            self.state["sum"] = torch.full_like(table, t.initial_accumulator_value)
        elif t.optimizer == "adamw":
            self.state.update(exp_avg=torch.zeros_like(table), exp_avg_sq=torch.zeros_like(table),
                              step=torch.zeros(table.shape[0], dtype=torch.int64))

    def extend(self, rows: torch.Tensor) -> None:
        """Append rows (a GEO worker's cache grows): they start with fresh optimizer state."""
        self.table = torch.cat([self.table, rows.float()])
        fresh = {"sum": self.t.initial_accumulator_value, "exp_avg": 0.0, "exp_avg_sq": 0.0, "step": 0}
        for k, v in self.state.items():
            self.state[k] = torch.cat([v, torch.full((rows.shape[0], *v.shape[1:]), fresh[k], dtype=v.dtype)])

    def step(self, idx: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply one update to rows `idx` (distinct) with their gradients `grad` (len(idx), dim), fp32."""
        self.write(idx, self.update(idx, grad))

    def update(self, idx: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """The new values of rows `idx` ("param") and of their optimizer state, computed on copies: nothing
        changes until `write` (so a caller can refuse an update first)."""
        t, p = self.t, self.table[idx]
        if t.optimizer == "sgd":
            return {"param": p - (t.lr * (grad + t.weight_decay * p) if t.weight_decay else t.lr * grad)}
        if t.optimizer == "adagrad":
            g = grad + t.weight_decay * p if t.weight_decay else grad
            acc = self.state["sum"][idx] + g * g
            return {"param": p - t.lr * g / (acc.sqrt() + t.eps), "sum": acc}
        return self._adamw(idx, p, grad)

    def write(self, idx: torch.Tensor, new: dict[str, torch.Tensor]) -> None:
        """Store what `update` computed."""
        self.table[idx] = new["param"]
        for k, v in new.items():
            if k != "param":
                self.state[k][idx] = v

    def _adamw(self, idx: torch.Tensor, p: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        t, s = self.t, self.state
        b1, b2 = t.betas
        steps = s["step"][idx] + 1
        m = s["exp_avg"][idx].lerp_(grad, 1 - b1)
        v = s["exp_avg_sq"][idx].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        tt = steps.to(torch.float64).unsqueeze(1)
        bc1, bc2_sqrt = (1 - b1 ** tt).float(), (1 - b2 ** tt).sqrt().float()
        p = p * (1 - t.lr * t.weight_decay)
        return {"param": p - t.lr / bc1 * m / (v.sqrt() / bc2_sqrt + t.eps), "step": steps, "exp_avg": m,
                "exp_avg_sq": v}

    def state_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.state.values())
