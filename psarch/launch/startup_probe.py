"""This machine's start-up of one rank, measured before a run whose world restarts after a kill
(faults.restart): a spawned interpreter, as the launcher spawns each rank, that imports what a rank imports (this
module's imports: torch, its process groups, the runner and the backends), builds the run's workload and takes
its first batch, timed from its spawn to its answer, beside N - 1 busy processes (psarch.cluster.messages'
`spinning`, as dilation's probes: the world's other ranks start at the same time on the same cores).

failure_cost predicts each restart's start-up by it, in the cluster's time (÷ D), never by what the run itself
measured. It leaves out what one process alone cannot show: the emulated cluster's namespaces and links made
again, the ranks' rendezvous and the checkpoint read (a restart has them all)."""
from __future__ import annotations

import json
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed  # noqa: F401  (a rank imports it: part of what is timed)

from psarch import registry
from psarch.cluster.messages import ProbeError, spinning
from psarch.config import Config, from_dict
from psarch.launch import runner  # noqa: F401  (a rank's training loop: imported, as a rank does, to be timed)
from psarch.launch.lifecycle import die_with_parent, leave
from psarch.workload import build_workload

LIMIT_S = 600.0   # the probe's spawn to its answer, this machine's clock; past it the probe fails, naming itself


def startup_s(cfg: Config, threads: int) -> float:
    """Seconds (this machine's clock) from spawning one rank of `cfg` to its first batch in hand, its
    world_size - 1 peers spinning meanwhile; `threads`: the rank's torch threads, as the launcher gives it."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    with spinning(max(0, cfg.backend.world_size - 1)):
        began = time.monotonic()
        proc = ctx.Process(target=_rank_start, args=(cfg.to_dict(), threads, child, registry.plugins()),
                           name="psarch-startup-probe", daemon=True)
        proc.start()
        child.close()
        try:
            if not parent.poll(LIMIT_S):
                raise ProbeError(f"faults.restart: the start-up probe (one rank spawned to its first batch) did not "
                                 f"answer within {LIMIT_S:g} s; this machine is too loaded to time a restart")
            got = json.loads(parent.recv_bytes())
        except EOFError:
            raise ProbeError(f"faults.restart: the start-up probe exited ({proc.exitcode}) before it answered") \
                from None
        finally:
            took = time.monotonic() - began
            proc.kill()
            proc.join()
            parent.close()
    if "error" in got:
        raise ProbeError(f"faults.restart: the start-up probe failed: {got['error']}")
    return took


def _rank_start(cfg_dict: dict[str, Any], threads: int, conn: Connection, plugins: list[str]) -> None:
    """The probe's rank: as a spawned rank begins (psarch.launch.ranks._rank_main), up to its first batch."""
    die_with_parent()
    try:
        torch.set_num_threads(threads)
        registry.import_plugins(plugins)   # before the config names a backend registered outside psarch
        cfg = from_dict(cfg_dict)
        workload = build_workload(cfg)
        workload.batch(0, 0, cfg.backend.world_size)
        conn.send_bytes(json.dumps({"ok": True}).encode())
    except BaseException as e:   # said to the probe, which raises it as one line
        conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}".splitlines()[0]}).encode())
        leave(1)
    leave(0)
