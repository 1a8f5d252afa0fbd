"""Run a function on N local ranks joined in a gloo process group (multi-process tests, benchmarks).

    from psarch.launch.spawn import run_ranks

    def check(rank: int, world_size: int, n: int) -> dict:   # module level, so spawned ranks can import it
        ...                                                    # torch.distributed is initialised (gloo)
        return {"rank": rank, "ok": True}                    # JSON-able: it comes back as JSON text

    results = run_ranks(check, 3, 10)                         # [result of rank 0, rank 1, rank 2]

Guarantees: every rank runs with one intra-op thread and a gloo group over a TCPStore the parent
hosts on a free port; if any rank raises, dies or the timeout passes, every rank is killed and the
parent raises RankError (with each failing rank's remote traceback) or TimeoutError. It never hangs.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from psarch.launch import processes
from psarch.launch.lifecycle import die_with_parent, ended, leave

# Every rank is on this machine: talk over loopback, whatever the hostname resolves to.
LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"


class RankError(RuntimeError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, timeout: float,
               results: mp.Queue, args: tuple) -> None:
    """Entry point of one spawned rank: join the group, run fn, report ("ok", json) or ("error", traceback).
    It never returns: once its report is in the pipe it leaves with os._exit (psarch.launch.lifecycle.leave), its
    group never destroyed (psarch.dist.shutdown says why), so gloo's threads never meet a destructor or the
    interpreter's finalisation, where they can abort a finished process."""
    die_with_parent()  # a test run that is killed leaves no ranks behind
    code = 0
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK)
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        out = json.dumps(fn(rank, world_size, *args))
        dist.barrier()      # no rank leaves while a peer still talks to it
        sys.stdout.flush()  # the parent may terminate this rank as soon as it has every result
        sys.stderr.flush()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        code = 1
    results.close()
    results.join_thread()   # the report is written to the pipe before the process ends
    leave(code)


def _stop(procs: list) -> None:
    """Terminate every rank still alive, then kill what ignores it."""
    procs = [p for p in procs if p.pid is not None]  # start() may have failed part-way
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size spawned ranks; return their results, by rank.

    fn and args must be picklable (fn defined at module level); fn's return value must be JSON-able.
    Raises RankError if a rank raised or exited without reporting, TimeoutError after `timeout` seconds
    (start-up included); in both cases all ranks are killed first.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = processes.context()
    # The parent hosts the store on a free port, so concurrent test runs never collide on a port.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    results: mp.Queue = ctx.Queue()
    procs = [processes.process(ctx, _rank_main, (fn, r, world_size, store.port, timeout, results, args),
                               name=f"rank{r}", daemon=True) for r in range(world_size)]
    outcomes: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout

    def drain(wait: float) -> None:
        try:
            rank, status, payload = results.get(timeout=wait)
            outcomes[rank] = (status, payload)
            while True:
                rank, status, payload = results.get_nowait()
                outcomes[rank] = (status, payload)
        except queue.Empty:
            pass

    try:
        for p in procs:
            p.start()
        while len(outcomes) < world_size:
            drain(0.2)
            if any(status == "error" for status, _ in outcomes.values()):
                drain(0.5)  # a moment for the other ranks' tracebacks, which often tell the story
                break
            silent = [r for r, p in enumerate(procs) if r not in outcomes and not p.is_alive()]
            if silent:
                drain(0.5)  # its report may still be in the pipe behind its exit
                for r in silent:
                    why = f"rank {r} {ended(procs[r].exitcode)} without reporting; see its stderr"
                    outcomes.setdefault(r, ("error", why))
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in outcomes]
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout} s; "
                                   f"all ranks were killed")
        if all(status == "ok" for status, _ in outcomes.values()):
            for p in procs:  # a clean exit is quick once every rank has reported; _stop handles the rest
                p.join(max(0.0, min(2.0, deadline - time.monotonic())))
    finally:
        _stop(procs)
        results.close()
        del store
    errors = {r: text for r, (status, text) in sorted(outcomes.items()) if status == "error"}
    if errors:
        body = "\n".join(f"--- rank {r} ---\n{text}" for r, text in errors.items())
        raise RankError(f"{len(errors)} of {world_size} ranks failed:\n{body}")
    return [json.loads(outcomes[r][1]) for r in range(world_size)]
