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


@pytest.mark.parametrize("probe, args", [(message_s, (3, 2, "sgd")), (hop_s, ("ring",)), (hop_s, ("native",))])
def test_each_probe_answers_a_cost_per_message_in_bounded_time(probe, args):
    """A real server's pushpulls (3 workers, 2 partitions), a gloo ring hop, gloo's own all-reduce: a cost per message between 1 us and
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


def test_a_probes_args_must_key_its_cache():
    """A list in args would fail in the cache with a bare TypeError: refused when the probe is made, in one line."""
    with pytest.raises(ValueError, match="args must be a tuple of str, int or float"):
        MessageProbe("x", time.monotonic, ([4],))


def test_a_ring_probe_measures_the_path_its_comm_takes():
    """ddp with comm "native" rides gloo's own collectives, not the ring's hops: its probe says so, and the two are
    measured apart (they key the cache apart)."""
    from psarch.config import from_dict
    from psarch import registry
    probes = {comm: registry.spec_of(cfg).message_probe(cfg, 1e6) for comm in ("ring", "native")
              for cfg in [from_dict({"backend": {"kind": "ddp", "world_size": 2, "comm": comm}})]}
    assert probes["ring"].family == "a ring hop over gloo" and probes["native"].family == "gloo's own all-reduce"
    assert probes["ring"] != probes["native"]


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


def test_another_sides_failure_is_named_not_taken_for_a_slow_machine():
    """A probe waits on one side's answer; its other side failing meanwhile (a ring's rank 1, the PS probe's
    server) stops the wait at once with that side's own error, not a "too loaded" timeout."""
    t0 = time.monotonic()
    with pytest.raises(ProbeError, match="the other side failed: ValueError: no server here"):
        with forked(_failing) as other, forked(_silent) as conn:
            receive(conn, "the answering side", time.monotonic() + 30, (other, "the other side"))
    assert time.monotonic() - t0 < 20
    with forked(_gone) as other, forked(_answers) as conn:   # a side that ends without a word is let go
        time.sleep(0.2)
        assert receive(conn, "the answering side", time.monotonic() + 30, (other, "the other side")) == {"seconds": 0.5}
