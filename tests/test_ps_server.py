"""A parameter server answers single requests a PSClient would never send (bad loss scales, a handler's bug,
two pulls at once, stale and non-finite pushes, row requests without rows) and changes nothing it should not:
spoken to a live server (threads of the test process) over a raw DEALER socket."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from psarch.config import from_dict
from psarch.ps.auth import Credentials
from psarch.ps.worker.client import PSClient, Request
from psarch.flat import FlatParams
from psarch.ps.layout import server_partitions, server_ranges
from psarch.ps.worker.link import ServerLink
from psarch.ps.errors import PSError
from psarch.workload import build_workload
from ps_setup import Raw, config, ps


def _fetch(raw: Raw) -> torch.Tensor:
    r = raw.ask({"op": "fetch", "worker": 0})
    assert r.op == "params", r.header
    return r.tensor().clone()


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_fp16_pushes_with_a_bad_loss_scale_are_refused(server, mode):
    """A loss scale of 0 once crashed an async server (ZeroDivisionError). A scale must be a power of two
    >= 1 (in sync: the server's own, 2^16 at first); found_inf = false with inf in the gradient is a lie."""
    services, numel = server(mode, "fp16")
    raw = server.raw(services.info.addresses[0])
    before = _fetch(raw)
    g = torch.full((numel,), 0.5, dtype=torch.float16)
    push = {"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0}
    bad = [dict(push, scale=s, found_inf=False) for s in (0.0, 0, -1.0, 1e-300, 3.0, 0.5, 2.0**-3)]
    bad.append(dict(push, found_inf=False))                               # no scale at all
    if mode == "sync":
        bad.append(dict(push, scale=2.0**15, found_inf=False))            # not the server's scale
    for header in bad:
        r = raw.ask(header, g)
        assert r.op == "error" and "scale" in r.header["message"], (header, r.header)
    inf = g.clone()
    inf[3] = float("inf")
    r = raw.ask(dict(push, scale=2.0**16, found_inf=False), inf)
    assert r.op == "error" and "inf/nan" in r.header["message"]
    assert torch.equal(_fetch(raw), before)
    r = raw.ask(dict(push, scale=2.0**16, found_inf=False), g)           # the server still serves
    assert r.op == "ack", r.header
    if mode != "sync":   # applied at once: -lr * g (scale 2^16 unscaled by the same 2^16)
        torch.testing.assert_close(_fetch(raw), before - 0.5 * g.float() / 2**16)


def test_a_bug_in_a_handler_is_answered_logged_and_fails_the_server_only_if_state_changed(server, capsys):
    """A last resort: an unexpected exception gets an `internal error` reply and a traceback on stderr
    instead of ending the serve loop. Before the state changed the server goes on; after (here: the
    optimizer step raising mid-update) it fails, rather than serve parameters it cannot trust."""
    import threading

    from psarch.ps.layout import initial_flat
    from psarch.ps.server.parameter_server import ParameterServer

    cfg = from_dict(config("bug", train={"optimizer": "sgd", "lr": 0.5}, workload={"model": "mlp"},
                           backend=ps(2, "async")))
    srv = ParameterServer(0, cfg, creds=Credentials("none"))
    srv.initialize(initial_flat(cfg))
    srv.handlers["fetch"] = lambda ident, msg: 1 / 0                    # a bug before any change
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    raw = server.raw(srv.address)
    try:
        r = raw.ask({"op": "fetch", "worker": 0})
        assert r.op == "error" and "internal error: ZeroDivisionError" in r.header["message"]
        g = torch.randn(srv.state.size)
        assert raw.ask({"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0}, g).op == "ack"
        assert srv.state.failure is None and srv.state.parts[0].range.version == 1
        srv.state.parts[0].range.optim.optimizer.step = lambda: 1 / 0             # a bug in the middle of an update
        r = raw.ask({"op": "push", "worker": 1, "step": 0, "version": 0, "offset": 0}, g)
        assert r.op == "error" and "internal error: ZeroDivisionError" in r.header["message"]
        assert srv.state.failure is not None and "while applying 'push' of worker 1" in srv.state.failure
        r = raw.ask({"op": "pull", "worker": 0, "step": 1, "want": "float32"})
        assert r.op == "error" and "internal error" in r.header["message"]   # every later request hears it
        assert thread.is_alive()
    finally:
        srv.stop()
        thread.join(5)
    err = capsys.readouterr().err
    assert err.count("Traceback") == 2 and "internal error handling 'push' of worker 1" in err


def test_a_worker_waits_for_one_pull_at_a_time(server):
    """sync: worker 1's pull for step 1 waits for worker 0; a second one is refused at once (the waiting
    queue cannot grow), and the first is answered when the round completes."""
    services, numel = server("sync")
    addr = services.info.addresses[0]
    w0, w1 = server.raw(addr, 0), server.raw(addr, 1)
    g0, g1 = torch.randn(numel), torch.randn(numel)
    before = _fetch(w0)
    assert w1.ask({"op": "push", "worker": 1, "step": 0, "version": 0, "offset": 0}, g1).op == "ack"
    w1.send({"op": "pull", "worker": 1, "step": 1, "want": "float32"})
    assert w1.reply(300) is None                                   # waits for worker 0's gradient
    r = w1.ask({"op": "pull", "worker": 1, "step": 1, "want": "float32"})
    assert r.op == "error" and "already has a pull waiting" in r.header["message"]
    r = w1.ask({"op": "pushpull", "worker": 1, "step": 1, "version": 0, "offset": 0}, g1)
    assert r.op == "error"
    assert "already has a pull waiting" in r.header["message"]   # refused for the waiting pull, before the step
    assert w0.ask({"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0}, g0).op == "ack"
    r = w1.reply()
    assert r is not None and r.op == "params" and r.header["version"] == 1
    torch.testing.assert_close(r.tensor(), before - 0.5 * (g0 + g1) / 2)


def test_dc_asgd_compensates_a_stale_gradient_of_a_second_worker(server):
    """Two workers pull w0; worker 0's gradient moves the parameters to w1; worker 1's gradient (stale by
    one) is compensated: w1 - lr·(g + λ·g⊙g⊙(w1 − w0)), with w1 − w0 = −lr·g_0 ≠ 0. Two servers, each
    compensating its own range with what it last sent worker 1; λ = 0 gives plain async (the term matters)."""
    lam, lr = 0.5, 0.5
    results = {}
    for lam_ in (lam, 0.0):
        services, numel = server("async", servers=2, staleness_compensation="dc", dc_lambda=lam_)
        client = {w: PSClient(services.info.addresses, w, 10.0, services.info.auth) for w in (0, 1)}
        try:
            w0 = torch.empty(numel)
            for w in (0, 1):   # both pull version 0
                client[w].exchange([[Request({"op": "pull", "step": 0, "want": "float32"}, into=w0[lo:hi])]
                                    for lo, hi in server_ranges(numel, 2)])
            g0 = torch.randn(numel, generator=torch.Generator().manual_seed(1))
            g1 = 4 * torch.randn(numel, generator=torch.Generator().manual_seed(2))
            for w, g in ((0, g0), (1, g1)):
                if w == 1:  # the server is the authority on staleness: claiming a fresher version is refused
                    lo, hi = server_ranges(numel, 2)[0]
                    with pytest.raises(PSError, match="says it computed on version 1, this server last sent it "
                                                      "version 0"):
                        client[1].exchange([[Request({"op": "push", "step": 0, "version": 1, "offset": lo},
                                                     g[lo:hi])], []])
                # worker 0 pulls again after its push: only worker 1's own record (w0) may be used for it
                reqs = [[Request({"op": "push", "step": 0, "version": 0, "offset": lo}, g[lo:hi]),
                         Request({"op": "pull", "step": 1, "want": "float32"}, into=torch.empty(hi - lo))]
                        for lo, hi in server_ranges(numel, 2)]
                client[w].exchange(reqs)
                assert [r[0].reply["staleness"] for r in reqs] == [w, w]
            final = torch.empty(numel)
            client[0].exchange([[Request({"op": "fetch"}, into=final[lo:hi])] for lo, hi in server_ranges(numel, 2)])
            results[lam_] = final
        finally:
            for c in client.values():
                c.close()
    w1 = w0 - lr * g0
    torch.testing.assert_close(results[lam], w1 - lr * (g1 + lam * g1 * g1 * (w1 - w0)))
    torch.testing.assert_close(results[0.0], w1 - lr * g1)
    assert (results[lam] - results[0.0]).abs().max() > 1e-3, "the compensation term did not matter"


@pytest.mark.parametrize("barrier", [True, False])
def test_geo_after_a_lost_worker_moves_by_the_mean_delta_of_the_others(server, barrier):
    """Workers push delta/N; with worker 2 of 3 lost the server scales the deltas by N/2, so the model
    moves by the mean of the two deltas left (not by 2/3 of it). Pushes of a lost worker are refused."""
    services, numel = server("geo", workers=3, geo_barrier=barrier)
    addr = services.info.addresses[0]
    raw = {w: server.raw(addr, w) for w in range(3)}
    before = _fetch(raw[0])
    services.worker_lost(2, "killed by the test")
    time.sleep(0.3)   # the launcher's pipe is read between requests
    d = [torch.randn(numel) for _ in range(2)]
    r = raw[2].ask({"op": "push", "worker": 2, "step": 0, "version": 0, "offset": 0}, d[0] / 3)
    assert r.op == "error" and "lost" in r.header["message"]
    for w in (0, 1):
        assert raw[w].ask({"op": "push", "worker": w, "step": 0, "version": 0, "offset": 0}, d[w] / 3).op == "ack"
    torch.testing.assert_close(_fetch(raw[0]), before + (d[0] + d[1]) / 2)


@pytest.mark.parametrize("mode,precision", [("sync", "fp32"), ("async", "fp32"), ("async", "bf16"),
                                            ("sync", "fp16"), ("async", "fp16"), ("geo", "fp32"),
                                            ("geo", "bf16")])
def test_non_finite_pushes_are_refused_and_counted(server, mode, precision):
    """A gradient (GEO: delta) holding inf or nan in any mode and precision is refused with code
    non_finite and counted for its worker; the parameters stay bit-identical. In fp16 a push that
    declares found_inf = true is the designed skipped step and is accepted."""
    services, numel = server(mode, precision)
    raw, raw1 = server.raw(services.info.addresses[0]), server.raw(services.info.addresses[0], 1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    fp16 = {"scale": 2.0**16, "found_inf": False} if precision == "fp16" and mode != "geo" else {}
    before = _fetch(raw)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, numel // 2, numel - 1):
            g = torch.full((numel,), 0.25, dtype=dtype)
            g[where] = bad
            r = raw1.ask(dict({"op": "push", "worker": 1, "step": 0, "version": 0, "offset": 0}, **fp16), g)
            assert r.op == "error" and r.header.get("code") == "non_finite", r.header
            assert "worker 1's" in r.header["message"] and "inf/nan" in r.header["message"]
    assert torch.equal(_fetch(raw), before), "a refused push changed the parameters"
    g = torch.full((numel,), 0.25, dtype=dtype)
    r = raw1.ask({"op": "push", "worker": 1, "step": 0, "version": 0, "offset": 0, **fp16}, g)
    assert r.op == "ack", r.header   # the refused pushes did not count as the worker's step
    stats = services.finish()
    assert stats["refused_pushes"]["non_finite_per_worker"] == [0, 9]
    if fp16:   # declared overflow: a skipped step, accepted
        r = raw.ask({"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0, "scale": 2.0**16,
                     "found_inf": True}, torch.full((numel,), float("inf"), dtype=dtype))
        assert r.op == "ack", r.header


@pytest.mark.parametrize("mode", ["sync", "async", "geo"])
def test_non_finite_partition_pushes_are_refused_and_counted(server, mode):
    """In partitions of 256 elements: a push of one partition holding nan is refused with code non_finite and
    counted, the parameters stay bit-identical, and the same partition's clean push is then the worker's step."""
    services, numel = server(mode, partition_mb=0.001)
    raw, raw1 = server.raw(services.info.addresses[0]), server.raw(services.info.addresses[0], 1)
    before = _fetch(raw)
    g = torch.full((256,), 0.25)
    g[17] = float("nan")
    push = {"op": "push", "worker": 1, "step": 0, "version": 0, "offset": 256}
    r = raw1.ask(push, g)
    assert r.op == "error" and r.header.get("code") == "non_finite" and "inf/nan" in r.header["message"], r.header
    assert torch.equal(_fetch(raw), before), "a refused partition push changed the parameters"
    assert raw1.ask(push, torch.full((256,), 0.25)).op == "ack"
    assert services.finish()["refused_pushes"]["non_finite_per_worker"] == [0, 1]


def test_a_row_request_to_a_server_without_rows_is_told_so(server):
    """rowpull / rowpush / rowfetch are requests: a dense server says it holds no rows (not "a reply")."""
    services, _ = server("async")
    raw = server.raw(services.info.addresses[0], 0)
    for header, tensor in (({"op": "rowpull", "worker": 0, "step": 0, "want": "float32"}, torch.tensor([0])),
                           ({"op": "rowfetch", "worker": 0}, None)):
        r = raw.ask(header, tensor)
        assert r.op == "error" and "this server holds no embedding rows" in r.header["message"], r.header


def _alone(w0: Raw, numel: int, rounds: range) -> None:
    """Worker 0 pushes rounds `rounds` (each step's gradient) and pulls each round's parameters: worker 1 is lost
    (or is dropped within the round's timeout)."""
    for k in rounds:
        r = w0.ask({"op": "pushpull", "worker": 0, "step": k, "version": k, "offset": 0}, torch.randn(numel))
        assert r.op == "params" and r.header["version"] == k + 1, r.header


def test_sync_refuses_a_dropped_workers_waiting_pull_as_lost_and_never_takes_back_one_that_died(server):
    """Worker 1 pushes round 1 and waits for its pull, then asks to rejoin at round 2 (the server drops it): the
    waiting pull is answered at once as a lost worker's, with the server's version (not left unanswered until the
    worker's timeout). Its process then dies while its rejoin is held: the rejoin is refused, never taken back
    once worker 0's rounds reach 2, and the drop says it died."""
    services, numel = server("sync")
    addr = services.info.addresses[0]
    w0, w1 = server.raw(addr, 0), server.raw(addr, 1)
    w1.send({"op": "pushpull", "worker": 1, "step": 0, "version": 0, "offset": 0}, torch.randn(numel))
    assert w1.reply(300) is None                                   # round 1 waits for worker 0
    w1.send({"op": "rejoin", "worker": 1, "step": 2})
    r = w1.reply()
    assert r is not None and r.op == "error" and r.header.get("code") == "lost" and r.header["version"] == 0
    assert w1.reply(300) is None                                   # the rejoin is held until round 2
    services.worker_lost(1, "killed by the test")
    r = w1.reply()
    assert r is not None and r.op == "error" and "died" in r.header["message"], r and r.header
    _alone(w0, numel, range(2))
    assert w1.reply(300) is None
    r = w1.ask({"op": "rejoin", "worker": 1, "step": 3})
    assert r.op == "error" and "declared lost" in r.header["message"]
    drops = services.finish()["servers_detail"][0]["drops"]
    assert drops == [{"worker": 1, "from_round": 0, "died": True, "readmitted_at": None}]


def test_sync_refuses_a_rejoin_at_a_passed_round_naming_its_newest_and_takes_it_back_at_the_next(server):
    """Worker 1, silent, is dropped from round 1 after backend.timeout_s; once worker 0 has taken the server to round
    2, worker 1's rejoin at round 1 is refused as "late" naming version 2; asked again at round 3, it is taken back
    there once worker 0's round 3 is in."""
    services, numel = server("sync", timeout_s=1.0)
    addr = services.info.addresses[0]
    w0, w1 = server.raw(addr, 0), server.raw(addr, 1)
    _alone(w0, numel, range(2))                                    # round 1 goes on without worker 1
    r = w1.ask({"op": "rejoin", "worker": 1, "step": 1})
    assert r.op == "error" and r.header.get("code") == "late" and r.header["version"] == 2, r.header
    w1.send({"op": "rejoin", "worker": 1, "step": 3})
    assert w1.reply(300) is None                                   # held until round 3
    _alone(w0, numel, range(2, 3))
    r = w1.reply()
    assert r is not None and r.op == "ack" and r.header["version"] == 3, r and r.header
    drops = services.finish()["servers_detail"][0]["drops"]
    assert drops == [{"worker": 1, "from_round": 0, "died": False, "readmitted_at": 3}]


def test_a_worker_refused_as_late_asks_to_rejoin_again_at_the_round_after_the_servers_newest(server):
    """The worker's side of the above: ServerLink.rejoin(1) on a server at round 2 is refused as "late", asks again
    at round 3 and is taken back there (once worker 0's round 3 is in), then pulls round 3's parameters."""
    services, numel = server("sync", timeout_s=1.0)
    cfg = services.cfg
    addr = services.info.addresses[0]
    w0 = server.raw(addr, 0)
    _alone(w0, numel, range(2))                                    # worker 1, silent, dropped from round 1
    round3 = threading.Timer(0.5, _alone, (w0, numel, range(2, 3)))
    round3.start()
    flat = FlatParams(list(build_workload(cfg).model.parameters()))
    client = PSClient(services.info.addresses, 1, 10.0, creds=services.info.auth)
    try:
        link = ServerLink(client, flat, server_partitions(cfg, flat.numel), torch.device("cpu"), torch.float32)
        assert link.rejoin(1) == 3 and link.versions == [3]
    finally:
        round3.join()
        client.close()
    torch.testing.assert_close(flat.data, _fetch(w0))
