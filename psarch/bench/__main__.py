"""`python -m psarch.bench NAME [ARGS]`: the same as `psarch bench NAME [ARGS]`."""
import sys

from psarch.bench import NAMES, run

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(f"usage: python -m psarch.bench {{{','.join(NAMES)}}} [ARGS]")
    sys.exit(run(sys.argv[1], sys.argv[2:]))
