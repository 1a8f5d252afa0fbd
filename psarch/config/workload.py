"""The [workload] section of a config: what is trained, a built-in model and data or a user's factory,
with one sub-table per built-in model and data set. Part of psarch.config, which re-exports every class."""
from __future__ import annotations

from dataclasses import dataclass

from psarch.config.fields import option, section


@dataclass
class GPTConfig:
    """Decoder-only transformer (pre-LayerNorm, causal self-attention, GELU MLP)."""

    n_layer: int = option(2, "number of transformer blocks", min=1)
    n_embd: int = option(64, "model width", min=1)
    n_head: int = option(4, "attention heads; must divide n_embd", min=1)
    mlp_ratio: int = option(4, "MLP hidden width as a multiple of n_embd", min=1)


@dataclass
class MLPConfig:
    """Token embedding followed by an MLP that predicts the next token from the current one."""

    n_embd: int = option(64, "embedding width", min=1)
    hidden: int = option(256, "hidden width", min=1)
    n_layer: int = option(2, "hidden layers", min=1)


@dataclass
class DLRMConfig:
    """DLRM: an embedding bag per sparse feature, a bottom MLP over dense features, a dot or concat
    interaction, a top MLP to one click logit (binary cross-entropy). Needs data = 'clicks'."""

    num_tables: int = option(4, "embedding tables (sparse features)", min=1)
    rows: int = option(10_000, "rows (ids) per table", min=1, max=10**8)
    dim: int = option(16, "embedding width, also the bottom MLP's output width", min=1)
    bag: int = option(1, "ids per table per sample (mean-pooled)", min=1)
    bottom_mlp: list = option([64], "hidden widths of the bottom MLP (dense features -> dim)")
    top_mlp: list = option([64], "hidden widths of the top MLP (interaction -> click logit)")
    interaction: str = option("dot", "how the bottom MLP's output and the embeddings meet: pairwise dot "
                                     "products (plus the bottom output), or their concatenation", choices=("dot", "cat"))


@dataclass
class ClicksConfig:
    """Synthetic clicks: Zipf-distributed ids, Gaussian dense features, labels from a hidden logistic
    model, so the best achievable loss is known. Table sizes come from [workload.dlrm]."""

    zipf: float = option(1.0, "Zipf exponent of id popularity (0: uniform); hot ids scattered by a seeded "
                              "permutation", min=0.0, max=4.0)
    dense: int = option(13, "dense features per sample", min=1)


@dataclass
class MarkovConfig:
    """Synthetic tokens from a random sparse Markov chain whose entropy rate is known exactly."""

    # Every rank builds the chain: O(vocab_size * branching) per power-iteration step, ~1 s at 2^16 states
    # with the default concentration, up to a minute for slow-mixing chains (concentration near 1e-6).
    vocab_size: int = option(64, "number of states (tokens)", min=2, max=2**16)
    branching: int = option(4, "successors per state (sparsity of the transition matrix)", min=1)
    concentration: float = option(1.0, "Dirichlet concentration of each row's probabilities", min=1e-6)


@dataclass
class TextConfig:
    """Bytes of a text file (vocabulary 256); sequences start at random offsets."""

    path: str = option("", "path of the text file (required for data = 'text')")


@dataclass
class WorkloadConfig:
    """What is trained: a built-in model and data, or a user's factory."""

    model: str = option("gpt", "built-in model ('dlrm' needs data = 'clicks')", choices=("gpt", "mlp", "dlrm"))
    data: str = option("markov", "built-in data ('clicks' needs model = 'dlrm')", choices=("markov", "text", "clicks"))
    factory: str = option("", "'package.module:function' returning a psarch.Workload; replaces model and data")
    seq_len: int = option(32, "tokens per sequence", min=1)
    gpt: GPTConfig = section(GPTConfig)
    mlp: MLPConfig = section(MLPConfig)
    dlrm: DLRMConfig = section(DLRMConfig)
    markov: MarkovConfig = section(MarkovConfig)
    text: TextConfig = section(TextConfig)
    clicks: ClicksConfig = section(ClicksConfig)
