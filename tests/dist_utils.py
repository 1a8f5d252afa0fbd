"""The tests' name for psarch.spawn: run a function on N local ranks in a gloo group."""
from psarch.spawn import RankError, run_ranks

__all__ = ["RankError", "run_ranks"]
