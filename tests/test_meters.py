"""Meters: traffic is only counted up, traffic of no step is booked under its own tag; peak memory on a
CPU is the rank's own, not what its launcher held when it spawned the rank."""
from __future__ import annotations

import multiprocessing as mp
import sys
import threading

import pytest
import torch

from psarch.meters import TrafficMeter, peak_memory
from timing import scaled

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
    child, kind = q.get(timeout=scaled(120))
    p.join(timeout=scaled(60))
    del held
    # the rank imported torch (~100-300 MiB) but allocated nothing: less than its launcher's peak
    assert kind == "rss" and 0 < child < parent - HELD // 2, (child, parent)


def test_traffic_tagged_scope_books_apart_and_bytes_only_count_up():
    m = TrafficMeter()
    m.add("all_gather", 10, 12)
    with m.tagged("export"):
        m.add("all_gather", 4, 5)
        t = threading.Thread(target=m.add, args=("all_gather", 2, 3))  # a communicator thread's count
        t.start()
        t.join()
    m.add("all_gather", 1, 1)
    ops = m.report().ops
    assert (ops["all_gather"].sent, ops["all_gather"].received, ops["all_gather"].calls) == (11, 13, 2)
    export = ops["export_all_gather"]
    assert (export.sent, export.received, export.calls) == (6, 8, 2)
    assert m.report().sent == 17
    for bad in [(-4, 0, 1), (0, -1, 1), (1, 1, -1)]:
        with pytest.raises(ValueError, match="counted up"):
            m.add("all_gather", *bad)
    with m.tagged("export"), pytest.raises(RuntimeError, match="do not nest"):
        with m.tagged("other"):
            pass
    with pytest.raises(ValueError, match="tag must be a name"):
        with m.tagged(""):
            pass
    m.add("all_gather", 1, 1)  # the failed nesting closed the outer scope on the way out
    assert m.report().ops["all_gather"].calls == 3 and m.report().ops["export_all_gather"].calls == 2
