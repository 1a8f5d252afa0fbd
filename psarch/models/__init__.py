"""Built-in models."""
from psarch.models.dlrm import DLRM
from psarch.models.gpt import GPT
from psarch.models.mlp import MLP

__all__ = ["DLRM", "GPT", "MLP"]
