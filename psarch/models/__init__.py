"""Built-in models."""
from psarch.models.gpt import GPT
from psarch.models.mlp import MLP

__all__ = ["GPT", "MLP"]
