"""The tests' name for psarch.launch.spawn: run a function on N local ranks in a gloo group."""
from psarch.launch.spawn import RankError, run_ranks

__all__ = ["RankError", "run_ranks"]
