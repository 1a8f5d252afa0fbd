"""Parameter-server checkpoints (psarch/ps/snapshot.py): bit-exact resume of sync (fp32, and fp16 with its loss
scaler; at N = 3 too, whoever arrives last); for async with DC-ASGD, SSP and GEO, the restored state of every
server and worker equals the saved one bit for bit (their continuation depends on the order pushes arrive,
which timing decides); forks onto ddp and single; the `save` op's checks."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import checkpoint_runs as cr
import parity
import ps_checkpoint_runs as pr
from psarch.checkpoint import Checkpoint
from psarch.config import from_dict
from psarch.ps import wire
from psarch.ps.auth import Credentials
from psarch.ps.worker.client import PSClient, Request
from psarch.ps.errors import PSError
from psarch.ps.layout import initial_flat
from psarch.ps.server.parameter_server import ParameterServer
from psarch.ps.services import start_services
from ps_setup import config, ps, run_stage


def _stage(out: Path, stage: str, fn) -> list:
    return run_stage(out, pr.servers(out, stage), fn, pr.N)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps_ckpt")
    return out, _stage(out, "straight", pr.straight), _stage(out, "resumed", pr.resumed)


@pytest.mark.parametrize("case", pr.EXACT)
def test_sync_resume_is_bit_exact(runs, case):
    out, straight, resumed = runs
    a, b = parity.model(out, case), parity.model(out, f"{case}-resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), case
    for rank in range(pr.N):   # the same losses, skips and loss scales; the step records before step 3 carried on
        assert resumed[rank][case] == straight[rank][case], (case, rank)
    if case.endswith("fp16"):   # the servers' scaler mattered: skips at 2 and 3 (hysteresis, then halved)
        assert [(r["loss_scale"], r["skipped"]) for r in straight[0][case]][2:5] == [
            (65536.0, True), (32768.0, True), (32768.0, False)]


def _skewed_stage(out: Path, stage: str) -> dict:
    return run_stage(out, pr.skewed_servers(out, stage), pr.skewed, pr.N3)[0]


def test_sync_at_n3_is_bit_exact_whoever_arrives_last_and_across_a_resume(tmp_path):
    """Worker 0 straggles in one run, worker 2 in another, and in a third resumed from the first's checkpoint
    at step 3: the rounds' sums go in worker order, so the three models are bit-identical."""
    straight = _skewed_stage(tmp_path, "straight")
    resumed = _skewed_stage(tmp_path, "resumed")
    models = {name: parity.model(tmp_path, name) for name in pr.SKEWED}
    a = models["n3-slow0"]
    for name, b in models.items():
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert straight["n3-slow2"] == straight["n3-slow0"]
    assert resumed["n3-slow2-resumed"] == straight["n3-slow0"]   # the step records before step 3 carried on


def _records(path: Path) -> tuple[dict, dict[tuple[str, str], torch.Tensor]]:
    ckpt = Checkpoint(path)
    try:
        data = {(e["name"], e["key"]): ckpt.read(e["name"], e["key"], 0, ckpt.params[e["name"]]["numel"])
                for e in ckpt.meta["fragments"]}
        return ckpt.state, data
    finally:
        ckpt.close()


@pytest.mark.parametrize("case", pr.RESTORED)
def test_restored_state_equals_the_saved_state(runs, case):
    """Restore every server and worker from checkpoint 3, write them again: every record and tensor (servers'
    ranges, optimizer state, DC backups; workers' models, GEO's local optimizer and synced copy) is the same."""
    out, _, resumed = runs
    saved_state, saved = _records(pr.checkpoint(out, case))
    again_state, again = _records(out / f"{case}-again" / "checkpoints" / f"step_{pr.AT:06d}")
    assert again_state == saved_state
    assert saved.keys() == again.keys()
    for key in saved:
        assert torch.equal(saved[key], again[key]), key
    keys = {k for _, k in saved}
    expect = {"async-dc": {"dc_backup/0", "dc_backup/1", "worker1/param"},
              "geo": {"worker0/master", "worker1/synced", "worker1/exp_avg_sq"}}.get(case, {"worker0/param"})
    assert expect <= keys, keys
    ps = saved_state["ps"]
    clocks = [[p["clock"] for p in s["partitions"]] for s in ps["servers"]]   # every partition of every server
    assert len(clocks) == pr.SERVERS and {tuple(c) for cs in clocks for c in cs} == {
        (pr.AT // 2 if case == "geo" else pr.AT,) * pr.N}
    if case == "geo":   # mid-round: the local model moved since the last synced copy
        names = {n for n, _ in saved}
        assert any(not torch.equal(saved[(n, "worker0/master")], saved[(n, "worker0/synced")]) for n in names)
    assert all(len(r[case]) == pr.STEPS - pr.AT for r in resumed)   # and the restored run steps on


def test_a_ps_checkpoint_forks_onto_ddp_and_single(runs):
    out, _, _ = runs
    reference = cr.single(out, "ps-to-single", pr.checkpoint(out, "sync-fp32"))
    parity.assert_same_model(parity.model(out, "ps-to-ddp"), reference, "ps sync -> ddp N=2")
    parity.assert_same_model(parity.model(out, "sync-fp32"), reference, "ps sync straight vs -> single")


def test_a_sync_checkpoint_forks_onto_async_and_geo(runs):
    """Each worker starts from the checkpoint's model as if it had just pulled: at step 6 the servers' records
    count the pushes since step 3 on top of the checkpoint's, a version per update (async: N per step)."""
    out, _, _ = runs
    for fork, pushes, version in (("sync-to-async", 6, 2 * 6), ("sync-to-geo", 6 // 2, 2 * (6 // 2))):
        state = Checkpoint(out / fork / "checkpoints" / "step_000006").state["ps"]
        parts = [p for s in state["servers"] for p in s["partitions"]]
        assert len(state["servers"]) == pr.SERVERS and parts, fork
        assert all(p["clock"] == [pushes] * pr.N and p["version"] == version for p in parts), fork


def test_each_server_writes_its_range_and_each_worker_its_model(runs):
    out, _, _ = runs
    meta = json.loads((pr.checkpoint(out, "sync-fp32") / "metadata.json").read_text())
    assert sorted(meta["files"]) == ["rank0.bin", "rank1.bin", "server0.bin", "server1.bin"]
    params = sum(p["numel"] for p in meta["params"].values())
    server_bytes = [meta["files"][f"server{i}.bin"]["bytes"] for i in range(2)]
    assert sum(server_bytes) == 3 * 4 * params   # param, exp_avg, exp_avg_sq in fp32, split over the servers
    assert meta["state_keys"] == ["exp_avg", "exp_avg_sq"]   # the workers' records are no optimizer state
    assert [[p["version"] for p in s["partitions"]] for s in meta["state"]["ps"]["servers"]] == [[pr.AT], [pr.AT]]
    assert sorted(meta["rng"]) == ["0", "1"]   # each worker's generators (dropout); servers draw none


def _serve(tmp_path: Path, every: int):
    cfg = from_dict(config("save", train={"optimizer": "sgd", "lr": 0.1, "checkpoint_every": every},
                           backend=ps(1, timeout_s=30.0)))
    services = start_services(cfg, tmp_path / "run", threads=True)
    return services, PSClient(services.info.addresses, 0, 10.0, services.info.auth)


def test_save_outside_the_run_checkpoint_folder_or_at_a_wrong_step_is_refused(tmp_path):
    services, client = _serve(tmp_path, 1)
    try:
        for path, step, says in [(tmp_path / "elsewhere", 0, "is not this run's folder"),
                                 (tmp_path / "nul\x00byte", 0, "is not this run's folder"),
                                 (tmp_path / "run" / "checkpoints" / ".tmp_step_000001" / "..", 1, "not this run"),
                                 (tmp_path / "run" / "checkpoints" / ".tmp_step_000002", 2, "has pushed 0 time")]:
            with pytest.raises(PSError, match=says):
                client.exchange([[Request({"op": "save", "step": step, "path": str(path)})]])
        assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "run" / "checkpoints").exists()
    finally:
        client.close()
        services.stop()


def test_a_server_of_a_run_without_checkpoints_writes_none(tmp_path):
    services, client = _serve(tmp_path, 0)
    try:
        with pytest.raises(PSError, match="without a run folder"):
            client.exchange([[Request({"op": "save", "step": 0, "path": str(tmp_path / "run" / "checkpoints"
                                                                              / ".tmp_step_000000")})]])
    finally:
        client.close()
        services.stop()


def test_an_async_save_waits_for_a_worker_that_is_behind_while_it_pushes(tmp_path):
    """async: worker 0 asks to save at step 3 while worker 1, still pushing, takes longer than timeout_s to get
    there; the save waits for it and is written. A worker that says nothing for timeout_s fails the save.
    (A server driven by handle() and _check_deadlines(); replies go to identities nobody holds.)"""
    cfg = from_dict(config("slow", train={"optimizer": "sgd", "lr": 0.1, "checkpoint_every": 3},
                           workload={"model": "mlp"}, backend=dict(ps(2, "async"), timeout_s=1.0)))
    ckpts = tmp_path / "checkpoints"
    srv = ParameterServer(0, cfg, creds=Credentials("none"), checkpoints=ckpts)
    srv.initialize(initial_flat(cfg))

    def send(w: int, header: dict, tensor: torch.Tensor | None = None) -> None:
        srv.handle([f"w{w}".encode(), *[bytes(f) for f in wire.encode(dict(header, worker=w), tensor)]])

    def push(w: int, step: int) -> None:
        send(w, {"op": "push", "step": step, "version": 0, "offset": 0}, torch.zeros(srv.state.size))

    def save(w: int, step: int) -> None:
        (ckpts / f".tmp_step_{step:06d}").mkdir(parents=True, exist_ok=True)
        send(w, {"op": "save", "step": step, "path": str(ckpts / f".tmp_step_{step:06d}")})

    try:
        for step in range(3):
            push(0, step)
        save(0, 3)
        for step in range(3):   # 1.2 s in all, 0.4 s between pushes
            time.sleep(0.4)
            srv.check_deadlines()
            push(1, step)
        save(1, 3)
        assert srv.state.failure is None and srv.state.rejected == 0
        assert (ckpts / ".tmp_step_000003" / "server0.json").exists()
        for step in range(3, 6):
            push(0, step)
        save(0, 6)
        time.sleep(1.2)
        srv.check_deadlines()
        assert srv.state.failure is not None and "no word from worker(s) [1] within 1 s" in srv.state.failure
    finally:
        srv.close()
