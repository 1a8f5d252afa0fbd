"""Benchmarks: each measures psarch against the peer a user would otherwise run (PyTorch's own DDP, ZeRO, FSDP2,
pipelining and tensor parallelism, raw pyzmq, a hand-written training loop), built side by side in the same ranks
and stepped in turn so they see the same machine load, and prints ratios; none is a test. One module per
benchmark, each with `main(argv)`, run by `psarch bench NAME [ARGS]` (or `python -m psarch.bench NAME [ARGS]`):
`step` (one process, psarch's step against a plain loop; also `python -m psarch.bench_step`), `allreduce` (the
ring against torch.distributed's all-reduce), `ddp`, `zero`, `zero-stages`, `ps` (the wire and the server),
`pipeline` and `tensor`. `shared` holds what they all use: trainers stepped by the runner's own loop, in turn.
This package sits above the backends (it names them and their torch peers); nothing else in psarch imports it.
"""

NAMES = ("step", "allreduce", "ddp", "zero", "zero-stages", "ps", "pipeline", "tensor")


def run(name: str, argv: list[str]) -> int:
    """Run benchmark `name` (one of NAMES) with its own command-line arguments `argv`."""
    import importlib

    if name not in NAMES:
        raise SystemExit(f"psarch bench: unknown benchmark {name!r}; choose one of {', '.join(NAMES)}")
    return importlib.import_module(f"psarch.bench.{name.replace('-', '_')}").main(argv) or 0
