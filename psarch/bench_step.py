"""The documented entry of `psarch bench step` (psarch/bench/step.py), kept because the team's GPU instructions
name it: `python -m psarch.bench_step --device cuda` is `psarch bench step --device cuda`."""
from psarch.bench.step import main

if __name__ == "__main__":
    main()
