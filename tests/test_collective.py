"""Communicators: ring (plain and pipelined) against torch.distributed's own collectives, bytes, async, errors.

Spawning ranks costs seconds on a small machine, so one spawn of 4 ranks runs every check at world sizes 1-4
(the world, then subgroups) and reports a list of failures back; the parent asserts that list is empty.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from collective.communicators import (Communicator, NativeCommunicator, PlainRingCommunicator, RingCommunicator,
                                       make_communicator)
from collective.comm import SerialExecutor, check_flat, check_scatter_pair
from timing import scaled

try:
    from tests.dist_utils import RankError, run_ranks
except ImportError:  # tests/ on sys.path rather than the repository root
    from dist_utils import RankError, run_ranks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Unit roundoff of each dtype. A ring step adds two values and rounds once, so any order of summing N values
# is within (N-1)*u*sum|x_i| of the exact sum (Higham, recursive summation, to first order); two different
# orders (our ring vs gloo's) are within twice that of each other. bf16 keeps 8 significant bits (u = 2^-8),
# fp16 11 (u = 2^-11): an exact-in-principle bound, rather than a guessed rtol.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# 1 and 2 (fewer elements than ranks), primes (not divisible by N), 1009 = many segments at 256-byte segments.
LENGTHS = (1, 2, 7, 13, 1009)


def _inputs(rank: int, numel: int, dtype: torch.dtype, integer: bool, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s input, reproducible on every rank so each can compute the exact reference."""
    g = torch.Generator().manual_seed(1_000_003 * salt + 7919 * rank + numel + 17 * integer)
    if integer:  # |sum| <= 4 * 8 = 32: exact in every dtype (bf16 holds integers up to 256 exactly)
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g).to(dtype)


class _Failures(list):
    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.append(what)


def _check_sum(fails: _Failures, what: str, got: torch.Tensor, xs: list[torch.Tensor], integer: bool) -> None:
    """got must equal the sum of xs: bitwise for integer-valued inputs, within the rounding bound otherwise."""
    exact = torch.stack([x.double() for x in xs]).sum(0)
    if integer:
        fails.expect(torch.equal(got, exact.to(got.dtype)), f"{what}: integer-valued sum not exact")
        return
    bound = (len(xs) - 1) * UNIT_ROUNDOFF[got.dtype] * torch.stack([x.double().abs() for x in xs]).sum(0)
    err = (got.double() - exact).abs()
    fails.expect(bool((err <= 1.01 * bound + 1e-30).all()), f"{what}: error {err.max():.3g} above bound")


def _expect_traffic(fails: _Failures, what: str, comm: Communicator, op: str, sent: int, received: int) -> None:
    rep = comm.traffic.report()
    o = rep.ops.get(op)
    got = (o.sent, o.received, o.calls) if o else None
    fails.expect(got == (sent, received, 1), f"{what}: traffic {got}, want {(sent, received, 1)}")
    fails.expect(rep.modelled == isinstance(comm, NativeCommunicator), f"{what}: modelled flag {rep.modelled}")
    comm.traffic.reset()


def _check_collectives(fails: _Failures, rank: int, n: int, comms: dict[str, Communicator]) -> None:
    """Every op x dtype x length x value kind on every communicator, against the exact result and each other."""
    for dname, dtype in DTYPES.items():
        isz = torch.empty(0, dtype=dtype).element_size()
        for numel in LENGTHS:
            for integer in (False, True):
                case = f"{dname} L={numel} {'int' if integer else 'rand'}"
                xs = [_inputs(r, numel, dtype, integer) for r in range(n)]
                big = [_inputs(r, n * numel, dtype, integer, salt=1) for r in range(n)]
                got: dict[str, dict[str, torch.Tensor]] = {}
                for name, comm in comms.items():
                    w = f"{name} {case}"
                    out = got[name] = {}
                    t = xs[rank].clone()
                    comm.all_reduce(t)
                    _check_sum(fails, f"{w} all_reduce", t, xs, integer)
                    c = math.ceil(numel / n) * isz
                    _expect_traffic(fails, f"{w} all_reduce", comm, "all_reduce", 2 * (n - 1) * c, 2 * (n - 1) * c)
                    out["all_reduce"] = t

                    inp = big[rank].clone()
                    rs = torch.full((numel,), float("nan"), dtype=dtype)
                    comm.reduce_scatter(rs, inp)
                    _check_sum(fails, f"{w} reduce_scatter", rs, [b[rank * numel:(rank + 1) * numel] for b in big],
                               integer)
                    fails.expect(torch.equal(inp, big[rank]), f"{w} reduce_scatter modified its input")
                    v = (n - 1) * numel * isz
                    _expect_traffic(fails, f"{w} reduce_scatter", comm, "reduce_scatter", v, v)
                    out["reduce_scatter"] = rs

                    ag = torch.full((n * numel,), float("nan"), dtype=dtype)
                    comm.all_gather(ag, xs[rank])
                    fails.expect(torch.equal(ag, torch.cat(xs)), f"{w} all_gather wrong")
                    _expect_traffic(fails, f"{w} all_gather", comm, "all_gather", v, v)

                    for src in range(n):
                        b = xs[rank].clone()
                        comm.broadcast(b, src=src)
                        fails.expect(torch.equal(b, xs[src]), f"{w} broadcast from {src} wrong")
                        s = numel * isz
                        _expect_traffic(fails, f"{w} broadcast src={src}", comm, "broadcast",
                                        s if (rank - src) % n != n - 1 else 0, s if rank != src else 0)
                for name in comms:  # the pipelined ring keeps the plain ring's summation order: bitwise equal
                    if name.startswith("ring"):
                        for op in ("all_reduce", "reduce_scatter"):
                            fails.expect(torch.equal(got[name][op], got["plain"][op]),
                                         f"{name} {case} {op} differs from the plain ring")
                if dtype == torch.float32 and not integer:
                    for name in comms:
                        for op in ("all_reduce", "reduce_scatter"):
                            try:
                                torch.testing.assert_close(got[name][op], got["native"][op], rtol=1e-5, atol=1e-6)
                            except AssertionError as e:
                                fails.append(f"{name} {case} {op} vs native: {e}")


def _check_async(fails: _Failures, rank: int, n: int, comms: dict[str, Communicator]) -> None:
    """Back-to-back async ops, a sync op in between, waited in reverse: same results as sync calls."""
    lengths = (1, 13, 1009, 3000, 64)
    for name, comm in comms.items():
        xs = [_inputs(rank, m, torch.float32, False, salt=2) for m in lengths]
        sync = [x.clone() for x in xs]
        for t in sync:
            comm.all_reduce(t)
        ts = [x.clone() for x in xs]
        handles = [comm.all_reduce(t, async_op=True) for t in ts[:3]]
        mid = ts[3]
        comm.all_reduce(mid)  # synchronous, queued behind the async ones
        handles.append(comm.all_reduce(ts[4], async_op=True))
        inp = _inputs(rank, 4 * n, torch.float32, True, salt=3)
        rs, ag = torch.empty(4), torch.empty(4 * n * n)
        handles.append(comm.reduce_scatter(rs, inp, async_op=True))
        handles.append(comm.all_gather(ag, inp, async_op=True))
        for h in reversed(handles):
            fails.expect(h is not None, f"{name}: async_op=True returned no handle")
            h.wait()
            h.wait()  # waiting twice is harmless
        for m, t, s in zip(lengths, ts, sync):
            fails.expect(torch.equal(t, s), f"{name} async all_reduce L={m} differs from sync")
        want_rs = sum(_inputs(r, 4 * n, torch.float32, True, salt=3) for r in range(n))[rank * 4:(rank + 1) * 4]
        fails.expect(torch.equal(rs, want_rs), f"{name} async reduce_scatter wrong")
        fails.expect(torch.equal(ag, torch.cat([_inputs(r, 4 * n, torch.float32, True, salt=3) for r in range(n)])),
                     f"{name} async all_gather wrong")


def _check_bad_inputs(fails: _Failures, n: int, comms: dict[str, Communicator]) -> None:
    """Mistakes are caught before any rank communicates, with a message that says what was wrong."""
    bad = [
        (lambda c: c.all_reduce(torch.zeros(2, 3)), ValueError, "1-D"),
        (lambda c: c.all_reduce(torch.zeros(8)[::2]), ValueError, "contiguous"),
        (lambda c: c.all_reduce([1.0, 2.0]), TypeError, "torch.Tensor"),
        (lambda c: c.all_reduce(torch.zeros(4, dtype=torch.int64)), TypeError, "dtype"),
        (lambda c: c.reduce_scatter(torch.zeros(3), torch.zeros(3 * n + 1)), ValueError, f"{3 * n + 1}"),
        (lambda c: c.reduce_scatter(torch.zeros(3), torch.zeros(3 * n, dtype=torch.bfloat16)), TypeError, "dtype"),
        (lambda c: c.all_gather(torch.zeros(3 * n + 1), torch.zeros(3)), ValueError, f"{n} * 3"),
        (lambda c: c.all_gather(torch.zeros(3 * n).view(n, 3), torch.zeros(3)), ValueError, "1-D"),
        (lambda c: c.broadcast(torch.zeros(3), src=n), ValueError, "src"),
    ]
    for name, comm in comms.items():
        for i, (call, exc, words) in enumerate(bad):
            try:
                call(comm)
                fails.append(f"{name} bad input #{i}: no error")
            except exc as e:
                fails.expect(words in str(e), f"{name} bad input #{i}: message {str(e)!r} lacks {words!r}")
            except Exception as e:  # noqa: BLE001 - report the wrong kind of error
                fails.append(f"{name} bad input #{i}: {type(e).__name__} {e}, want {exc.__name__}")
        t = torch.ones(5)  # the communicator still works after refusing bad calls
        comm.all_reduce(t)
        fails.expect(torch.equal(t, torch.full((5,), float(n))), f"{name} broken after bad inputs")


# World sizes 1-4 in one spawn (starting ranks costs more than all the checks): the whole world through the
# default group, then subgroups, which also exercise group-rank -> global-rank mapping ([1, 3] is not 0-based).
LAYOUTS = [("world of 4", None), ("ranks [0, 1, 2]", [0, 1, 2]), ("ranks [1, 3]", [1, 3]), ("ranks [2]", [2])]


def _all_checks(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    groups = [(label, None if ranks is None else dist.new_group(ranks)) for label, ranks in LAYOUTS]
    fails = _Failures()
    for (label, group), (_, ranks) in zip(groups, LAYOUTS):
        if ranks is not None and rank not in ranks:
            continue
        comms: dict[str, Communicator] = {
            "plain": PlainRingCommunicator(group),
            "ring": make_communicator("ring", group),                     # 4 MiB segments: one per chunk here
            "ring-seg256": RingCommunicator(group, segment_bytes=256),    # many segments, window 4
            "ring-seg250-w3": RingCommunicator(group, segment_bytes=250, window=3),  # odd size, window < segments
            "native": NativeCommunicator(group),
        }
        r, n = comms["native"].rank, comms["native"].world_size
        local = _Failures()
        _check_collectives(local, r, n, comms)
        _check_async(local, r, n, comms)
        _check_bad_inputs(local, n, comms)
        for comm in comms.values():
            comm.barrier()
            comm.close()
        fails.extend(f"{label}, rank {r} (global {rank}): {f}" for f in local)
    return fails


@pytest.mark.slow
def test_communicators_match_native_at_world_sizes_1_to_4() -> None:
    results = run_ranks(_all_checks, 4, timeout=scaled(240))
    fails = [f for per_rank in results for f in per_rank]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:40])


# ---- no process group needed


def test_make_communicator_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match=r"'mpi'.*native, ring"):
        make_communicator("mpi")


def test_checks_name_the_problem() -> None:
    with pytest.raises(ValueError, match="1-D"):
        check_flat(torch.zeros(2, 2), "tensor")
    with pytest.raises(ValueError, match=r"7 elements.*2 \* 3 = 6"):
        check_scatter_pair(torch.zeros(7), torch.zeros(3), 2, "input", "output")
    check_scatter_pair(torch.zeros(6, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16), 2, "input", "output")


def test_executor_is_fifo_and_reraises() -> None:
    ex, order = SerialExecutor("test"), []
    handles = [ex.submit(lambda i=i: (time.sleep(0.01 * (3 - i)), order.append(i)), True, torch.empty(0))
               for i in range(3)]
    handles[-1].wait()
    assert order == [0, 1, 2] and all(h.is_completed() for h in handles)

    def boom() -> None:
        raise OSError("peer went away")

    h = ex.submit(boom, True, torch.empty(0))
    with pytest.raises(OSError, match="peer went away"):
        h.wait()
    with pytest.raises(RuntimeError, match="earlier collective failed"):
        ex.submit(lambda: None, False, torch.empty(0))
    ex.close()


# ---- the spawn helper itself: a failing rank or a hang must end the run, not the CI job


def _one_rank_fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    torch.distributed.barrier()  # would wait forever for rank 1


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(600)


@pytest.mark.slow
def test_run_ranks_reports_a_failing_rank_and_stops_the_rest() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1.*ValueError: rank one is broken"):
        run_ranks(_one_rank_fails, 2, timeout=scaled(60))
    assert time.monotonic() - t0 < scaled(30)   # half run_ranks' timeout at any load: the rest were stopped


@pytest.mark.slow
def test_run_ranks_times_out() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        run_ranks(_sleeps, 1, timeout=4)


# ---- the benchmark's raw point-to-point schedule: the ring's traffic, no arithmetic

def _p2p_moves_chunks(rank: int, world_size: int) -> dict:
    from psarch.bench.allreduce import _p2p_schedule

    t = torch.full((4 * world_size,), float(rank))
    recv = torch.empty(4)
    _p2p_schedule(t, recv, rank, world_size)
    return {"got": recv.tolist()}


@pytest.mark.slow
def test_p2p_schedule_sends_each_rank_its_predecessors_chunk() -> None:
    """Each round sends one S/N chunk to the next rank and receives the previous rank's (3 ranks)."""
    got = [r["got"] for r in run_ranks(_p2p_moves_chunks, 3, timeout=scaled(60))]
    assert got == [[2.0] * 4, [0.0] * 4, [1.0] * 4]


def test_bench_rows_take_the_median_of_per_run_ratios() -> None:
    """Each run's ratio pairs times taken under the same load; the fold takes their median, not a ratio of medians."""
    from psarch.bench.allreduce import format_table, measured_rows, median_rows

    kinds = ("ring", "native", "p2p")
    runs = [measured_rows([{"bytes": 1 << 20, "iters": 5, "ring": ring, "native": native, "p2p": p2p,
                            "ring cpu": 2 * ring, "native cpu": 3 * native, "p2p cpu": p2p}], 4, kinds)
            for ring, native, p2p in ((1.0, 2.0, 1.0), (4.0, 1.0, 3.0), (9.0, 3.0, 4.0))]
    row = median_rows(runs, kinds)[0]
    assert row["ring/native"] == 3.0  # per-run ratios 0.5, 4, 3; the ratio of the median times would be 4 / 2
    assert row["ring/p2p"] == 4.0 / 3.0 and row["p2p/native"] == 4.0 / 3.0  # 1, 4/3, 9/4 and 1/2, 3, 4/3
    assert row["cpu ring/native"] == 2.0  # cpu 2, 8, 18 against 6, 3, 9
    assert row["ring"]["time_s"] == 4.0 and row["native"]["cpu_s"] == 6.0
    assert row["ring"]["busbw"] == (1 << 20) / 4.0 * 2 * 3 / 4
    head = format_table([row], kinds).splitlines()[0]
    assert all(name in head for name in ("ring cpu", "p2p/native", "cpu ring/native"))
