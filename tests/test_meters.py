"""Peak memory on a CPU is the rank's own, not what its launcher held when it spawned the rank."""
from __future__ import annotations

import multiprocessing as mp
import sys

import pytest
import torch

from psarch.meters import peak_memory

HELD = 256 * 2**20


def _report_peak(q) -> None:
    q.put(peak_memory(torch.device("cpu")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="getrusage's inherited peak is a Linux matter")
def test_a_spawned_rank_reports_its_own_peak_not_its_launchers():
    held = torch.ones(HELD // 4)  # the launcher holds 256 MiB, touched, while it spawns the rank
    parent, kind = peak_memory(torch.device("cpu"))
    assert kind == "rss" and parent >= HELD
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_report_peak, args=(q,))
    p.start()
    child, kind = q.get(timeout=120)
    p.join(timeout=60)
    del held
    # the rank imported torch (~100-300 MiB) but allocated nothing: less than its launcher's peak
    assert kind == "rss" and 0 < child < parent - HELD // 2, (child, parent)
