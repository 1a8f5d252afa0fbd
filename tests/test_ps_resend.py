"""A request is applied once however many times it is sent (psarch/ps/worker/resend.py, psarch/ps/server/repeats.py;
issue 31): a reply lost with its connection (cut by the server's watchdog after the push was applied) is sent
again once the worker's connection is back, and the run ends with the model of the run that lost nothing, bit for
bit; a repeated id is answered and not applied again. A server and its workers run as threads of this process,
on loopback, the server on port 0."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import pytest
import torch
import zmq

from psarch.config import from_dict
from psarch.ps.auth import Credentials
from psarch.ps.layout import initial_flat
from psarch.ps.sparse import add_delta
from psarch.ps.server.parameter_server import ParameterServer
from psarch.ps.messages import SESSION_BITS
from psarch.ps.server.repeats import LIMIT, SESSIONS
from psarch.ps.worker.client import PSClient, Request
from ps_setup import Raw, config, ps
from timing import scaled

STEPS = 4


@contextlib.contextmanager
def serving(mode: str, workers: int, **train: Any) -> Iterator[ParameterServer]:
    """An MLP's server (plain SGD, 3 partitions) in a thread of this process, stopped after."""
    cfg = from_dict(config("resend", train=dict({"optimizer": "sgd", "lr": 0.1}, **train), workload={"model": "mlp"},
                           backend=ps(workers, mode, partition_mb=0.12, timeout_s=scaled(20))))
    srv = ParameterServer(0, cfg, creds=Credentials("none"))
    srv.initialize(initial_flat(cfg))
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.stop()
        thread.join(5)


def gradient(w: int, step: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * w + step))


def train(srv: ParameterServer, w: int, held: torch.Tensor, errors: list[BaseException]) -> None:
    """Worker w's STEPS steps: a pushpull per partition, back to back, then every reply, landing in `held`; in GEO
    with compression a pull of the parameters first, then each step's delta pushed in fp16 and the partition's
    change since what the worker holds added to `held`, as psarch/ps/worker/link.py adds it."""
    parts = [(p.lo, p.hi) for p in srv.state.parts]
    geo = srv.state.pulls_deltas
    client = PSClient([srv.address], w, timeout_s=scaled(20), heartbeat_s=0.0, resend_s=0.0)   # on reconnection only
    try:
        if geo:
            client.exchange([[Request({"op": "pull", "step": 0, "want": "float32", "offset": lo}, into=held[lo:hi])
                              for lo, hi in parts]])
        versions = [0] * len(parts)
        for step in range(STEPS):
            g = gradient(w, step, srv.state.size)
            op, push = ("pushpulldelta", g.half()) if geo else ("pushpull", g)
            reqs = [Request({"op": op, "step": step, "version": v, "offset": lo}, push[lo:hi],
                            into=None if geo else held[lo:hi]) for (lo, hi), v in zip(parts, versions)]
            for r in reqs:
                client.post(0, r)
            client.wait()
            versions = [r.reply["version"] for r in reqs]
            if geo:
                for (lo, hi), r in zip(parts, reqs):
                    add_delta(held[lo:hi], None, r.received)
        client.exchange([[Request({"op": "done"})]])
    except BaseException as e:   # said by the test
        errors.append(e)
    finally:
        client.close()


def run(mode: str, workers: int, cut: tuple[int, int] | None = None,
        **train_: Any) -> tuple[torch.Tensor, list[torch.Tensor], ParameterServer]:
    """The server's parameters and what each worker holds after every worker's STEPS steps; `cut` = (worker, step):
    the reply to that worker's request of the first partition at that step is never sent, its connection shut down
    instead, as the server's watchdog shuts one down (connections.py), after the push was applied."""
    with serving(mode, workers, **train_) as srv:
        doomed: set[bytes] = set()
        may_send = srv.connections.may_send

        def handler(op: str) -> Any:
            handle = srv.handlers[op]

            def cutting(ident: Any, msg: Any) -> None:
                h = msg.header
                if cut is not None and (h["worker"], h["step"], h["offset"]) == (*cut, 0) and not doomed:
                    doomed.add(bytes(ident))
                handle(ident, msg)
            return cutting

        def send_or_cut(ident: bytes, nbytes: int) -> bool:
            if ident not in doomed:
                return may_send(ident, nbytes)
            doomed.remove(ident)
            doomed.add(b"")   # once
            c = srv.connections
            with c.lock:
                fd = c.fds[ident]
                c._drop(fd, c.conns[fd], "unread")
            return False

        for op in ("pushpull", "pushpulldelta"):
            srv.handlers[op] = handler(op)
        srv.connections.may_send = send_or_cut   # type: ignore[method-assign]
        errors: list[BaseException] = []
        held = [torch.zeros(srv.state.size) for _ in range(workers)]
        threads = [threading.Thread(target=train, args=(srv, w, held[w], errors)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(scaled(60))
        assert not errors, errors
        return srv.state.params().clone(), held, srv


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("mode, workers, train_", [("sync", 2, {}), ("async", 1, {}),
                                                   ("geo", 1, {"compression": "fp16"})])
def test_a_reply_lost_with_its_connection_is_sent_again_and_the_push_applied_once(mode, workers, train_):
    """The reply to worker 0's push of step 2 (sync: the round's, 2 workers; GEO: a delta, which moved the server's
    copy of what the worker holds) is lost with its connection: the run ends as the run that lost nothing, bit for
    bit, the server's parameters and what the workers hold, with each push applied once."""
    clean, clean_held, srv0 = run(mode, workers, **train_)
    cut, cut_held, srv = run(mode, workers, cut=(0, 2), **train_)
    assert srv.connections.dropped["unread"] == 1 and srv.repeats.repeats >= 1   # the cut happened, and was repaired
    assert srv0.repeats.repeats == 0
    parts = len(srv.state.parts)
    assert parts == 3
    assert srv.pushes.applied == srv0.pushes.applied == workers * STEPS * parts   # every push once
    assert same(cut, clean) and all(same(a, b) for a, b in zip(cut_held, clean_held))
    if mode != "geo":   # what a worker holds is what it was last sent
        assert all(same(h, clean) for h in clean_held)
    assert all(p.range.version == (STEPS if mode == "sync" else workers * STEPS) for p in srv.state.parts)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_repeated_request_id_is_answered_and_applied_once(server, mode):
    """The same pushpull, id and all, twice: two replies that name its id, one push applied; a request of another
    id is applied as its own."""
    services, numel = server(mode, workers=2)
    raw = server.raw(services.info.addresses[0])
    g = torch.randn(numel)
    push = {"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0, "rid": 7}
    first, again = raw.ask(push, g), raw.ask(push, g)
    assert first.op == again.op == "ack", (first.header, again.header)
    assert first.header == again.header and first.header["rid"] == 7
    fetched = raw.ask({"op": "fetch", "worker": 0, "rid": 8})
    assert fetched.header["version"] == (0 if mode == "sync" else 1)   # sync: the round waits for worker 1
    other = raw.ask(dict(push, rid=9), g)   # a new request: step 0 again is refused as the server always has
    assert other.op == "error" and "step 0" in other.header["message"] and other.header["rid"] == 9


def test_a_repeat_of_a_waiting_pull_is_answered_on_the_connection_it_came_on():
    """sync: worker 1's pushpull waits for worker 0's push; its connection closes, and the same request, id and all,
    comes on a new one: the round's reply goes there, once, and worker 1's push is summed once."""
    with serving("sync", 2) as srv:
        zctx = zmq.Context()
        try:
            lo, hi = srv.state.parts[0].lo, srv.state.parts[0].hi
            g0, g1 = gradient(0, 0, hi - lo), gradient(1, 0, hi - lo)
            before = srv.state.parts[0].range.params.clone()
            push = {"op": "pushpull", "worker": 1, "step": 0, "version": 0, "offset": lo, "rid": 5}
            first = Raw(zctx, srv.address, None, worker=1)
            first.send(push, g1)
            assert first.reply(300) is None                      # waits for worker 0
            first.sock.close(0)
            again = Raw(zctx, srv.address, None, worker=1)
            again.send(push, g1)
            assert again.reply(300) is None                      # still waits, now on this connection
            w0 = Raw(zctx, srv.address, None, worker=0)
            assert w0.ask(dict(push, worker=0, rid=1), g0).op == "params"
            r = again.reply(int(scaled(5) * 1000))
            assert r is not None and r.op == "params" and r.header["rid"] == 5 and r.header["version"] == 1
            assert again.reply(300) is None                      # one reply
            torch.testing.assert_close(r.tensor(), before - 0.1 * (g0 + g1) / 2)
            assert srv.pushes.applied == 2 and srv.repeats.repeats == 1
        finally:
            zctx.destroy(linger=0)


def test_a_copy_read_late_off_an_older_connection_does_not_take_the_reply_back_to_it():
    """sync: worker 1's waiting pushpull comes on connection A, again on a newer B, then once more on A (a copy
    still queued on a dropped connection, read after its repeat): the round's reply goes to B, the newer."""
    with serving("sync", 2) as srv:
        zctx = zmq.Context()
        try:
            lo, hi = srv.state.parts[0].lo, srv.state.parts[0].hi
            g0, g1 = gradient(0, 0, hi - lo), gradient(1, 0, hi - lo)
            push = {"op": "pushpull", "worker": 1, "step": 0, "version": 0, "offset": lo, "rid": 5}
            old, new = Raw(zctx, srv.address, None, worker=1), Raw(zctx, srv.address, None, worker=1)
            old.send(push, g1)
            assert old.reply(300) is None
            new.send(push, g1)
            assert new.reply(300) is None
            old.send(push, g1)                                   # the late copy
            assert old.reply(300) is None
            w0 = Raw(zctx, srv.address, None, worker=0)
            assert w0.ask(dict(push, worker=0, rid=1), g0).op == "params"
            r = new.reply(int(scaled(5) * 1000))
            assert r is not None and r.op == "params" and r.header["rid"] == 5, "the reply did not reach B"
            assert old.reply(300) is None and srv.pushes.applied == 2 and srv.repeats.repeats == 2
        finally:
            zctx.destroy(linger=0)


def test_an_id_older_than_every_one_kept_is_refused_and_another_clients_ids_are_its_own():
    """A server keeps LIMIT + 2 per partition of a worker's ids (past twice that, down to it): an id older than those
    cannot be told applied or not, and is refused; a new client (another session in the id's high bits) starts anew."""
    with serving("async", 1) as srv:
        zctx = zmq.Context()
        try:
            raw = Raw(zctx, srv.address, None, worker=0)
            session = 3 << SESSION_BITS
            kept = LIMIT + 2 * len(srv.state.parts)
            for n in range(2 * kept + 1):
                assert raw.ask({"op": "fetch", "worker": 0, "rid": session + n}).op == "params"
            r = raw.ask({"op": "fetch", "worker": 0, "rid": session})
            assert r.op == "error" and f"worker 0's request {session} is older than the {kept}" in r.header["message"]
            assert raw.ask({"op": "fetch", "worker": 0, "rid": session + 2 * kept}).op == "params"   # kept: a repeat
            assert raw.ask({"op": "fetch", "worker": 0, "rid": (4 << SESSION_BITS)}).op == "params"   # a new client
            assert srv.repeats.repeats == 1
            for header, said in (({"op": "fetch", "worker": 5, "rid": 1}, "this run has workers 0..0"),
                                 ({"op": "ack", "version": 0, "rid": 1}, "is a reply, not a request")):
                r = raw.ask(header)   # refused as without an id, no internal error
                assert r.op == "error" and said in r.header["message"] and "internal" not in r.header["message"]
            assert srv.state.failure is None
        finally:
            zctx.destroy(linger=0)


def test_a_request_of_a_session_forgotten_after_newer_ones_is_refused_not_handled_again():
    """async: worker 0's client session A pulls version 0; SESSIONS newer clients of worker 0 come (A's entries
    forgotten), the newest pushes step 0 on version 0. A's pull comes again, id and all (a copy read late off its
    dead client's connection), and a new request of A's: both refused in one line, and the server's record of what
    the worker holds is unchanged, so the live client's next push on version 0 is applied (before: A's pull was
    answered as new, the record moved to version 1 and the live client's push was refused)."""
    with serving("async", 1) as srv:
        zctx = zmq.Context()
        try:
            raw = Raw(zctx, srv.address, None, worker=0)
            part = srv.state.parts[0]
            g = gradient(0, 0, part.hi - part.lo)
            pull = {"op": "pull", "worker": 0, "step": 0, "want": "float32", "offset": part.lo,
                    "rid": 3 << SESSION_BITS}
            assert raw.ask(pull).header["version"] == 0
            live = [(4 + n) << SESSION_BITS for n in range(SESSIONS)]
            for rid in live[:-1]:
                assert raw.ask({"op": "fetch", "worker": 0, "rid": rid}).op == "params"
            push = {"op": "push", "worker": 0, "step": 0, "version": 0, "offset": part.lo, "rid": live[-1]}
            assert raw.ask(push, g).op == "ack" and part.range.version == 1
            for again in (pull, dict(pull, rid=pull["rid"] + 1)):   # the repeat, and a new id of A's
                r = raw.ask(again)
                assert r.op == "error", (r.op, r.header)
                assert (f"worker 0's request {again['rid']} is of a client session this server has forgotten "
                        f"({SESSIONS} newer ones came since): it cannot tell") in r.header["message"]
            assert part.range.sent_version[0] == 0                      # what the server records the worker holds
            r = raw.ask(dict(push, step=1, rid=live[-1] + 1), g)        # the live client, on the version it holds
            assert r.op == "ack", r.header
            assert srv.pushes.applied == 2 and srv.state.failure is None
        finally:
            zctx.destroy(linger=0)


def test_a_run_whose_server_stopped_past_the_heartbeat_timeout_ends_with_the_model_of_the_run_without_it(tmp_path):
    """`psarch run`, sync: server 0 stopped (SIGSTOP) for 2 s as step 3 begins, heartbeats 0.2 s apart and dropped
    after 0.6 s: each worker's connection drops with its pushpull on it, and once the server is back the worker sends
    it again. The run ends with the model of the run without the pause, bit for bit, every push applied once (before:
    the workers waited backend.timeout_s for replies no server had a request for, and the run stopped)."""
    import psarch
    from parity import assert_same_model
    sgd = {"optimizer": "sgd", "lr": 0.1, "steps": 8}
    backend = ps(2, heartbeat_s=0.2, heartbeat_timeout_s=0.6, timeout_s=scaled(30))
    plain = psarch.run(from_dict(config("plain", train=sgd, backend=backend)), tmp_path / "plain", echo=False)
    paused = psarch.run(from_dict(config("paused", train=sgd, backend=backend,
                                         faults={"pause": [{"node": "server 0", "step": 3, "seconds": 2.0}]})),
                        tmp_path / "paused", echo=False)
    assert paused["steps"] == plain["steps"] == 8 and paused["faults"][0]["resumed_at_s"] > 0
    (srv,), (srv0,) = paused["servers_detail"], plain["servers_detail"]
    assert srv["applied_pushes"] == srv0["applied_pushes"] == 2 * 8 and srv0["repeats"] == 0
    resent = [r["ops"].get("resend", {}).get("sent", 0) for r in paused["traffic"]["per_rank"]]
    assert all(resent), resent   # both workers sent their step's pushpull again
    assert_same_model(torch.load(tmp_path / "paused" / "model.pt", weights_only=True),
                      torch.load(tmp_path / "plain" / "model.pt", weights_only=True), "paused vs plain", rtol=0.0,
                      atol=0.0)


@pytest.mark.parametrize("backend, said", [
    ({"kind": "ps", "world_size": 2, "timeout_s": 10.0, "resend_timeout_s": 10.0}, "must be shorter than backend.timeout_s"),
    ({"kind": "ps", "world_size": 2, "servers": 2, "replicas": 1, "resend_timeout_s": 1.0}, "with backend.replicas"),
    ({"kind": "ddp", "world_size": 2, "embeddings": "ps", "timeout_s": 2.0, "resend_timeout_s": 3.0},
     "must be shorter than backend.timeout_s")])
def test_a_resend_timeout_that_cannot_hold_is_refused(backend, said):
    """A timer resend at or past the run's own timeout, or with replicas (which send nothing again), is refused."""
    from psarch.config import ConfigError
    workload = {"model": "dlrm", "data": "clicks"} if backend.get("embeddings") == "ps" else {"model": "mlp"}
    with pytest.raises(ConfigError, match=f"backend.resend_timeout_s = .*{said}"):
        from_dict(config("r", backend=backend, workload=workload))
