"""Tests' time limits stretch with the machine's load (tests/timing.py): a limit that holds on an idle machine
must not fail a test whose behaviour was right on a loaded one."""
from __future__ import annotations

import timing
from timing import MARGIN, scaled


def test_a_limit_stretches_by_the_load_per_core_and_never_shrinks(monkeypatch):
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (10.0, 6.0, 1.0))   # 5 runnable tasks a core
    assert scaled(60) == 60 * 5 * MARGIN
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (1.0, 8.0, 9.0))    # the load just fell: the 5-minute one
    assert scaled(60) == 60 * 4 * MARGIN
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (0.1, 0.2, 0.3))    # idle: the limit as written
    assert scaled(60) == 60 * MARGIN
