"""This machine's cost per message on a backend's own code path (psarch/cluster/messages.py, psarch/ps/probe.py,
collective/probe.py): each probe answers in bounded time with a cost per message, is measured once per probe and
process count, and one that fails or stays silent is cut off with one line naming it."""
from __future__ import annotations

import time

import pytest

from collective.probe import hop_s
from psarch.cluster import messages
from psarch.cluster.messages import MessageProbe, ProbeError, answer, forked, receive
from psarch.ps.probe import message_s


@pytest.mark.parametrize("probe, args", [(message_s, (3, 2, "sgd")), (hop_s, ())])
def test_each_probe_answers_a_cost_per_message_in_bounded_time(probe, args):
    """A real server's pushpulls (3 workers, 2 partitions), a gloo ring hop: a cost per message between 1 us and
    50 ms (this machine, at any load it can run a cluster at), in well under LIMIT_S (its first call pays torch's
    lazy imports of an optimizer once)."""
    probe(*args)
    t0 = time.monotonic()
    got = probe(*args)
    took = time.monotonic() - t0
    assert 1e-6 < got < 0.05, got
    assert took < 15, took


def test_a_probe_is_measured_once_per_process_count():
    """Sweeps resolve D per point: points with the same probe and process count share one measurement."""
    runs = []

    def run(*args):
        runs.append(args)
        return 1e-4
    messages.per_message_s.cache_clear()
    a, b = MessageProbe("x", run, (4, 2)), MessageProbe("x", run, (4, 2))
    assert messages.per_message_s(a, 8) == messages.per_message_s(b, 8) == 1e-4
    messages.per_message_s(a, 6)
    messages.per_message_s(MessageProbe("x", run, (4, 3)), 8)
    assert runs == [(4, 2), (4, 2), (4, 3)]
    messages.per_message_s.cache_clear()


def _silent(conn):
    time.sleep(600)


def _failing(conn):
    raise ValueError("no server here")


def _gone(conn):
    pass


def _answers(conn):
    answer(conn, seconds=0.5)


def test_a_silent_failing_or_gone_side_is_cut_off_in_one_line():
    """No hang: a side that does not answer by the deadline is killed and named; one that fails says why; one that
    leaves without an answer is named too; an answer comes through."""
    t0 = time.monotonic()
    with pytest.raises(ProbeError, match="a silent side did not answer within"):
        with forked(_silent) as conn:
            receive(conn, "a silent side", time.monotonic() + 0.5)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ProbeError, match="a failing side failed: ValueError: no server here"):
        with forked(_failing) as conn:
            receive(conn, "a failing side", time.monotonic() + 30)
    with pytest.raises(ProbeError, match="a gone side exited before it answered"):
        with forked(_gone) as conn:
            receive(conn, "a gone side", time.monotonic() + 30)
    with forked(_answers) as conn:
        assert receive(conn, "a side", time.monotonic() + 30) == {"seconds": 0.5}
