"""Each backend's step program (collective/program.py, zero/program.py, psarch/ps/program.py) simulated in full
(every rank and server its own node and ops) and by its reduction (one node standing for alike ones) agrees
within 1% at every N from 2 to 32, with latency, compute and overlap in play; and the programs a spec writes
from a config time what their formulas say."""
from __future__ import annotations

import pytest

from collective.program import ddp_program
from psarch import registry
from psarch.config import from_dict
from psarch.ps.program import Slot, groups_of, ps_program, ps_reduced
from psarch.theory.program import Cluster, DataStep, chunks
from psarch.theory.simulate import simulate
from zero.program import stage12_program, stage3_program

RATE, ALPHA = 1e9, 2e-5
STEP = DataStep.of(0.05)
S = 40e6          # bytes of gradients
SLOTS = [Slot(S / 8 / 4, (i + 1) / 4) for i in range(4)]   # a server's 4 partitions, ready through backward


def ps(k: int | str, colocated: bool = False, uneven: bool = False):
    """The PS with k servers of SLOTS each (uneven: every other one a partition short, as round robin deals)."""
    def write(n: int, reduced: bool):
        count = n if k == "n" else (max(1, n // 2) if k == "n/2" else int(k))
        servers = [SLOTS[:3] if uneven and j % 2 else SLOTS for j in range(count)]
        if reduced:
            return ps_reduced(n, groups_of(servers), colocated, STEP)
        return ps_program(n, servers, colocated, STEP)
    return write


PROGRAMS = {
    "ddp, overlap": lambda n, r: ddp_program(n, chunks(S, S / 4), STEP, True, r),
    "ddp, after backward": lambda n, r: ddp_program(n, chunks(S, S / 3), STEP, False, r),
    "zero-1/2": lambda n, r: stage12_program(n, chunks(S, S / 3), chunks(S, S / 2), STEP, True, r),
    "zero-3": lambda n, r: stage3_program(n, [S / 3] * 3, STEP, r),
    "torch_zero": lambda n, r: stage12_program(n, chunks(S, S / 3), [S], STEP, True, r, reduce_passes=2),
    "ps, 1 server": ps(1),
    "ps, 2 servers": ps(2),
    "ps, n servers": ps("n"),
    "ps, n colocated": ps("n", colocated=True),
    "ps, n/2 colocated": ps("n/2", colocated=True),
    "ps, n servers, uneven": ps("n", uneven=True),
    "ps, n colocated, uneven": ps("n", colocated=True, uneven=True),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_full_and_reduced_agree_within_1_percent(name):
    write = PROGRAMS[name]
    for n in range(2, 33):
        full, reduced = write(n, False), write(n, True)
        a = simulate(full, Cluster.of(full, RATE, ALPHA)).step_s
        b = simulate(reduced, Cluster.of(reduced, RATE, ALPHA)).step_s
        assert b == pytest.approx(a, rel=0.01), f"{name} at N = {n}: full {a:.6g} s, reduced {b:.6g} s"


def test_specs_write_programs_whose_steps_match_the_formulas():
    """From a config, with compute 0 and no latency: the ring moves 2(N-1)/N S per rank, ZeRO-1 the same, ZeRO-3
    and torch's ZeroRedundancyOptimizer under DDP 3(N-1)/N S, the PS with N dedicated servers S each way at once, pipelined over its 16 partitions per server (plus
    one slot's pull to drain, 1/16 of S), with one server N S through its link each way."""
    from psarch import registry, theory

    phi, n, net = 25e6, 8, DataStep(0.0, 0.0)
    s = phi * 4

    def step(kind: str, **backend) -> float:
        cfg = theory.config_for(kind, n, "fp32", "adamw", **backend)
        p = registry.spec_of(cfg).program(cfg, phi, net, True)
        return simulate(p, Cluster.of(p, RATE)).step_s

    assert step("ddp") == pytest.approx(2 * (n - 1) / n * s / RATE)
    assert step("zero", stage=1) == pytest.approx(2 * (n - 1) / n * s / RATE)
    assert step("zero", stage=3) == pytest.approx(3 * (n - 1) / n * s / RATE)
    assert step("torch_zero") == pytest.approx(3 * (n - 1) / n * s / RATE)   # DDP's all-reduce, the broadcasts
    part = s / n / 16      # a range in 16 (rounded down to 64 elements: server 0 gets a 17th, short, a little more)
    assert step("ps", servers=n, partition_mb=part / 2**20) == pytest.approx((s + s / 16) / RATE, rel=3e-3)
    assert step("ps", servers=1, partition_mb=s / 2**20) == pytest.approx(2 * n * s / RATE)


@pytest.mark.parametrize("kind, options", [("ddp", {}), ("torch_ddp", {}), ("ps", {"servers": 2})])
def test_a_compressed_step_has_no_program_yet(kind, options):
    """The programs move uncompressed bytes: a compressed run is left to theory's byte counts, never simulated
    as if uncompressed."""
    cfg = from_dict({"train": {"compression": "fp16"}, "backend": {"kind": kind, "world_size": 2, **options}})
    assert registry.spec_of(cfg).program(cfg, 1e6, DataStep.of(0.1), False) is None
