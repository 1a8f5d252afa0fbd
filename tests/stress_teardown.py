"""Stress: do two-rank runs abort at teardown? (issue 20: gloo's threads can abort a finished process at
interpreter finalisation on torch 2.13, pytorch/pytorch#179291, even after destroy_process_group.)

    PSARCH_THREADS=1 python tests/stress_teardown.py --runs 200 [--backends ddp,zero,...,control]

Each psarch run is `psarch.launch.ranks.run` in this process: its two ranks are started as `psarch run` starts
them (forked from psarch's forkserver, psarch.launch.processes) and end through psarch's exit path
(psarch.launch.lifecycle.leave). `control` is the same kind of run without that path: two spawned ranks train PyTorch's DDP over gloo for two steps, destroy_process_group()
and return, so the interpreter finalises them as any plain script's processes. Not collected by pytest
(its name is no test_*.py); tests/test_teardown.py runs a few of these teardowns in the suite.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

BACKENDS = ("ddp", "zero", "torch_ddp", "torch_zero", "torch_fsdp")
CONTROL = "control"
STEPS = 2
TINY = {"workload.seq_len": 8, "workload.gpt.n_layer": 1, "workload.gpt.n_embd": 16, "workload.gpt.n_head": 2,
        "workload.markov.vocab_size": 16, "train.steps": STEPS, "train.global_batch": 4, "train.log_every": 1,
        "backend.world_size": 2}


@dataclass
class Tally:
    """How the runs of one backend ended: finished, aborted (a rank killed by SIGABRT), or failed otherwise."""

    backend: str
    runs: int = 0
    finished: int = 0
    aborted: int = 0            # runs in which a rank died of SIGABRT
    aborted_after_work: int = 0  # of those, ranks that had done all their work first (control only)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        after = f" ({self.aborted_after_work} of the aborted ranks after finishing their work)" \
            if self.backend == CONTROL else ""
        other = f"; {len(self.failures)} other failures, first: {self.failures[0]}" if self.failures else ""
        return (f"{self.backend:<11} {self.aborted:>3} aborts of {self.runs} runs{after}, {self.finished} finished"
                f"{other} [{self.seconds / max(self.runs, 1):.1f} s/run]")


def psarch_run(kind: str, out: Path) -> tuple[bool, str | None]:
    """One two-rank `psarch run` of `kind`: (finished with both ranks' records, the error if it failed)."""
    from psarch.config import load_config
    from psarch.launch.ranks import run

    try:
        summary = run(load_config(None, dict(TINY, **{"backend.kind": kind})), out, echo=False)
    except Exception as e:  # the run's own error, as `psarch run` would print it
        return False, f"{type(e).__name__}: {e}".splitlines()[0]
    ok = summary["status"] == "finished" and summary["steps"] == STEPS and len(summary["memory"]["per_rank"]) == 2
    return ok, None if ok else f"summary: status {summary['status']}, {summary['steps']} steps"


def _control_rank(rank: int, port: int, done: str) -> None:
    """A plain PyTorch DDP rank: train, destroy the group, mark the work done, return normally."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=60))  # 2 ranks + host
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    dist.destroy_process_group()
    Path(done).write_text("done\n")


def control_run(out: Path) -> list[tuple[int | None, bool]]:
    """One two-rank control run: (exit code, work done) per rank."""
    import torch.distributed as dist

    out.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")   # a fresh interpreter, finalised at exit as any plain script's processes
    done = [out / f"rank{r}.done" for r in range(2)]
    procs = [ctx.Process(target=_control_rank, args=(r, store.port, str(done[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
    return [(p.exitcode, d.is_file()) for p, d in zip(procs, done)]


def stress(backend: str, runs: int, root: Path) -> Tally:
    """`runs` two-rank teardowns of one backend (or of the control), each in a folder of its own under root."""
    tally = Tally(backend)
    start = time.monotonic()
    for i in range(runs):
        out = root / backend / str(i)
        tally.runs += 1
        if backend == CONTROL:
            ranks = control_run(out)
            aborted = [done for code, done in ranks if code == -signal.SIGABRT]
            tally.aborted += bool(aborted)
            tally.aborted_after_work += sum(aborted)
            tally.finished += all(code == 0 and done for code, done in ranks)
            tally.failures += [f"rank exit code {code}" for code, _ in ranks if code not in (0, -signal.SIGABRT)]
        else:
            finished, error = psarch_run(backend, out)
            tally.finished += finished
            if error is not None and "killed by SIGABRT" in error:
                tally.aborted += 1
            elif error is not None:
                tally.failures.append(error)
        shutil.rmtree(out, ignore_errors=True)
        if (i + 1) % 25 == 0 and i + 1 < runs:   # a partial tally, so a long stress that is cut off still says
            tally.seconds = time.monotonic() - start
            print(f"  so far: {tally.line()}", flush=True)
    tally.seconds = time.monotonic() - start
    return tally


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200, help="two-rank runs per backend")
    p.add_argument("--backends", default=",".join(BACKENDS + (CONTROL,)),
                   help=f"comma-separated, of {', '.join(BACKENDS + (CONTROL,))}")
    args = p.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS + (CONTROL,)]
    if bad or args.runs < 1:
        p.error(f"--backends {args.backends!r}: allowed {', '.join(BACKENDS + (CONTROL,))}; --runs must be >= 1")
    os.environ.setdefault("PSARCH_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="psarch-teardown-") as root:
        for b in backends:
            print(stress(b, args.runs, Path(root)).line(), flush=True)


if __name__ == "__main__":
    main()
