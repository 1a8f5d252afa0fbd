"""The step simulator (psarch/theory/simulate.py) by hand: max-min fair links, α per message, one transfer at a
time per connection, a reduced program's copies on its links, a step's parts, and a bad program's one-line error."""
from __future__ import annotations

import pytest

from psarch.theory.program import Cluster, Node, Program
from psarch.theory.simulate import fair_rates, simulate

RATE = 1e6     # bytes/s of every link


def uniform(nodes: int, alpha: float = 0.0) -> Cluster:
    return Cluster(tuple(Node(RATE, RATE) for _ in range(nodes)), alpha)


def test_links_share_max_min_fairly():
    """Three flows into node 2 get a third of its downlink each; the flow beside one of them on node 0's uplink
    takes what that one leaves (2/3), not half."""
    p = Program()
    for i, (src, dst) in enumerate(((0, 1), (0, 2), (3, 2), (4, 2))):
        p.transfer(f"t{i}", src, dst, RATE, i)
    # all four start at once: the one alone on node 1's downlink ends first, at 1.5 s (2/3 of the link), and the
    # other three at 3 s (a third each until then, then its share of what is left)
    got = simulate(p, uniform(5))
    assert got.step_s == pytest.approx(3.0)
    from psarch.theory.simulate import _Flow   # the rates themselves, before anything ends
    flows = [_Flow(op, uniform(5)) for op in p.ops]   # type: ignore[arg-type]
    assert fair_rates(flows, uniform(5)) == pytest.approx([2 / 3 * RATE] + [RATE / 3] * 3)


def test_alpha_per_message_and_one_transfer_at_a_time_per_connection():
    """Two transfers on one connection run one after the other, each paying α first; on two connections they
    share the link and pay α at once. A chain of m messages pays α m times."""
    alpha, b = 0.01, RATE / 2
    one = Program()
    one.transfer("a", 0, 1, b, "c")
    one.transfer("b", 0, 1, b, "c")
    one.compute("after_a", 1, 0.0, ("a",))
    assert simulate(one, uniform(2, alpha)).step_s == pytest.approx(2 * (alpha + b / RATE))
    two = Program()
    two.transfer("a", 0, 1, b, "c1")
    two.transfer("b", 0, 1, b, "c2")
    assert simulate(two, uniform(2, alpha)).step_s == pytest.approx(alpha + 2 * b / RATE)
    chain = Program()
    chain.transfer("a", 0, 1, b, "c", messages=5)
    assert simulate(chain, uniform(2, alpha)).step_s == pytest.approx(5 * alpha + b / RATE)


def test_copies_count_on_each_link_as_alike_transfers():
    """A push from a class of 4 workers to 1 server, standing for 4 copies: the server's downlink carries 4 at
    once (each at a quarter), a worker's uplink 1."""
    p = Program()
    w, s = p.node("worker", 4), p.node("server")
    p.transfer("push", w, s, RATE, "push", copies=4)
    assert simulate(p, Cluster.of(p, RATE)).step_s == pytest.approx(4.0)
    assert simulate(p, Cluster.of(p, RATE, server_rate=4 * RATE)).step_s == pytest.approx(1.0)


def test_parts_add_up_to_the_step():
    """Node 1 computes 1 s, then receives 1 s of bytes (exposed), while node 0 waits for it (idle): the busiest
    node is the one that ends last with the most compute."""
    p = Program()
    p.compute("c1", 1, 1.0)
    p.compute("c0", 0, 0.5)
    p.transfer("t", 0, 1, RATE, "c", ("c1",))
    got = simulate(p, uniform(2))
    assert got.step_s == pytest.approx(2.0)
    assert (got.compute_s, got.exposed_s, got.idle_s) == pytest.approx((1.0, 1.0, 0.0))
    p.compute("c0b", 0, 0.25, ("t",))   # now node 0 ends last: 0.5 compute, 1 s exposed, 0.5 idle, 0.25 compute
    got = simulate(p, uniform(2))
    assert got.step_s == pytest.approx(2.25)
    assert (got.compute_s, got.exposed_s, got.idle_s) == pytest.approx((0.75, 1.0, 0.5))


@pytest.mark.parametrize("ops, message", [
    ([("c", "x", ("nope",))], "waits for 'nope'"),
    ([("c", "x", ()), ("c", "x", ())], "two ops are named 'x'"),
    ([("c", "x", ("y",)), ("c", "y", ("x",))], "never ran"),
    ([("t", "x", ())], "to itself"),
])
def test_a_bad_program_says_what_is_wrong(ops, message):
    p = Program()
    for kind, name, after in ops:
        if kind == "c":
            p.compute(name, 0, 1.0, after)
        else:
            p.transfer(name, 0, 0, 1.0, "c", after)
    with pytest.raises(ValueError, match=message):
        simulate(p, uniform(1))
