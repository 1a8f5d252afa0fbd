"""Time limits for tests on a shared machine: a limit that holds on an idle machine, stretched by the load now."""
from __future__ import annotations

import os

MARGIN = 1.5   # room above the load-scaled limit: the load average lags the load a test meets


def load_factor() -> float:
    """How many times slower than idle this machine runs now: the larger of the 1- and 5-minute load averages per
    core, at least 1 (an idle machine's limits stand)."""
    return max(1.0, max(os.getloadavg()[:2]) / (os.cpu_count() or 1))


def scaled(seconds: float) -> float:
    """`seconds`, a limit that holds on an idle machine, for this machine's load now (x load_factor x MARGIN)."""
    return seconds * load_factor() * MARGIN
