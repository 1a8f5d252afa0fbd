"""The smallest GPT run the CLI tests start: one layer of width 16 on a 16-symbol Markov source, as TOML."""
from __future__ import annotations


def tiny(steps: int = 6, global_batch: int = 4, log_every: int = 2, train: str = "", rest: str = "") -> str:
    """The config's text; `train`: more [train] lines, `rest`: tables after it."""
    return f"""
seed = 1
[workload]
model = "gpt"
data = "markov"
seq_len = 8
[workload.gpt]
n_layer = 1
n_embd = 16
n_head = 2
[workload.markov]
vocab_size = 16
[train]
steps = {steps}
global_batch = {global_batch}
log_every = {log_every}
{train}
{rest}
"""
