"""Parameter-server runs as `psarch run` launches them (server processes): end to end, convergence
with stale gradients, the SSP bound, dead and hung workers, standalone `psarch server` processes; and
no orphan process after any of them."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import psarch
from parity import assert_same_model
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.ps.auth import keygen
from psarch.launch.runner import run_rank
from psarch.workload import build_workload
from ps_setup import OPTIMIZERS, TINY_GPT, config, ps
from timing import scaled


def dies_on_rank1_at_step3(cfg) -> psarch.Workload:
    """A tiny GPT whose rank 1 process dies abruptly when it fetches the batch of step 3."""
    return _with_batch_hook(cfg, lambda step, shard: os._exit(3) if (shard, step) == (1, 3) else None)


def dies_on_rank1_at_step3_rank0_pauses_at_step5(cfg) -> psarch.Workload:
    """Rank 1 dies at step 3; rank 0 (which ssp holds at step 5 until rank 1 is lost) then pauses 0.5 s:
    the silence of a worker the server kept waiting counts from its release, not from its last message."""
    def hook(step: int, shard: int) -> None:
        if (shard, step) == (1, 3):
            os._exit(3)
        if (shard, step) == (0, 5):
            time.sleep(0.5)
    return _with_batch_hook(cfg, hook)


def dies_on_rank0_at_step3(cfg) -> psarch.Workload:
    return _with_batch_hook(cfg, lambda step, shard: os._exit(3) if (shard, step) == (0, 3) else None)


def hangs_on_rank1_at_step3(cfg) -> psarch.Workload:
    return _with_batch_hook(cfg, lambda step, shard: time.sleep(3600) if (shard, step) == (1, 3) else None)


def slow_rank1(cfg) -> psarch.Workload:
    return _with_batch_hook(cfg, lambda step, shard: time.sleep(0.05) if shard == 1 else None)


def _with_batch_hook(cfg, hook) -> psarch.Workload:
    wl = build_workload(from_dict(dict(json.loads(json.dumps(TINY_GPT)), train=cfg.to_dict()["train"])))

    def batch(step: int, shard: int, num_shards: int):
        hook(step, shard)
        return wl.batch(step, shard, num_shards)

    return psarch.Workload(wl.model, wl.loss_fn, batch, wl.entropy_floor, "tiny-gpt-with-hook")


def _children() -> list[str]:
    """Processes this one started that still exist: its children (multiprocessing's resource tracker and forkserver
    excepted) and the forkserver's children (the ranks and servers psarch.launch.processes starts are those)."""
    me, table = os.getpid(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        table[int(pid)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmd)
    servers = {pid for pid, (ppid, cmd) in table.items() if ppid == me and "multiprocessing.forkserver" in cmd}
    return [f"{pid}: {cmd[:120]}" for pid, (ppid, cmd) in table.items()
            if ppid in servers or (ppid == me and pid not in servers and "resource_tracker" not in cmd)]


def launch(tmp_path: Path, name: str, **sections) -> tuple[dict, Path]:
    cfg = from_dict(config(name, **sections))
    out = tmp_path / name
    summary = psarch.run(cfg, out, echo=False)
    assert _children() == [], "orphan processes after the run"
    return summary, out


def test_end_to_end_sync_run_writes_server_traffic_and_a_loadable_model(tmp_path):
    summary, out = launch(tmp_path, "e2e", train=OPTIMIZERS["adamw"], backend=ps(2, servers=2))
    on_disk = json.loads((out / "summary.json").read_text())
    servers = on_disk["traffic"]["servers"]
    assert [s["server"] for s in servers] == [0, 1] and all(s["sent"] > 0 and s["received"] > 0 for s in servers)
    workers = on_disk["traffic"]["per_rank"]
    assert sum(s["received"] for s in servers) == sum(w["sent"] for w in workers)
    assert sum(s["sent"] for s in servers) == sum(w["received"] for w in workers)
    # authenticated by default (PLAIN on loopback); no push refused; the per-run credentials are gone
    assert on_disk["auth"] == "plain" and on_disk["refused_pushes"]["non_finite_per_worker"] == [0, 0]
    assert "auth: none" not in (out / "report.txt").read_text()
    assert on_disk["variant"] == "sync" and on_disk["servers"] == 2 and on_disk["lost_workers"] == []
    assert [m["optimizer"] for m in on_disk["memory"]["per_rank"]] == [0, 0]
    plain = build_workload(from_dict(TINY_GPT)).model
    plain.load_state_dict(torch.load(out / "model.pt", weights_only=True))   # strict: every key, every shape
    single = run_rank(from_dict(config("ref", train=OPTIMIZERS["adamw"])), DistContext(), echo=False)
    assert_same_model(torch.load(out / "model.pt", weights_only=True), single.model_state, "e2e ps vs single")


def test_async_four_workers_converge_with_stale_gradients(tmp_path):
    # Every worker sleeps 19x its compute each step (a straggler's sleep, no CPU), so each runs for seconds:
    # 40 bare steps take ~0.2 s, less than the ranks' start-up skew, and then no two workers overlap at all.
    summary, _ = launch(tmp_path, "async4", train={"optimizer": "adamw", "lr": 1e-2, "steps": 40, "global_batch": 16},
                        backend=ps(4, "async"), cluster={"slow_workers": [0, 1, 2, 3], "slowdown": 20.0})
    hist = {int(k): v for k, v in summary["staleness"]["histogram"].items()}
    assert sum(hist.values()) == 4 * 40
    assert sum(v for k, v in hist.items() if k > 0) > 0, f"no stale update at all: {hist}"
    rows = [json.loads(x) for x in (tmp_path / "async4" / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.3, f"async PS did not converge: {first:.3f} -> {last:.3f}"


def test_ssp_no_worker_runs_more_than_the_bound_ahead(tmp_path):
    bound = 1
    summary, out = launch(tmp_path, "ssp", workload={"factory": "test_ps_faults:slow_rank1"},
                          train={"optimizer": "sgd", "lr": 0.05, "steps": 10},
                          backend=ps(2, "ssp", staleness_bound=bound))
    ssp = summary["ssp"]
    assert ssp["max_ahead"] == bound, "the bound never bound (rank 1 is slow) or was broken"
    # replay the server's own record: a worker was let into step c only when every live worker had pushed
    # at least c - bound steps
    pushed, grants = [0, 0], 0
    for kind, worker, step in json.loads((out / ssp["trace_file"]).read_text()):
        if kind == 0:
            assert step == pushed[worker] + 1
            pushed[worker] = step
        else:
            assert step - min(pushed) <= bound, (worker, step, pushed)
            grants += 1
    assert pushed == [10, 10] and grants == 2 * 11   # the initial pull and one per step
    # and the workers' own rows say the same
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    aheads = [w["extra"]["ahead"] for r in rows for w in r["workers"]]
    assert len(aheads) == 20 and max(aheads) <= bound


@pytest.mark.parametrize("mode, extra, dead", [("async", {}, 0), ("geo", {"k_steps": 2, "geo_barrier": True}, 1),
                                               ("ssp", {"staleness_bound": 1}, 1)])
def test_a_dead_worker_does_not_stop_async_modes(tmp_path, mode, extra, dead):
    """The run finishes without the dead rank; model.pt comes from the servers (rank 0 dies in async)."""
    summary, out = launch(tmp_path, f"dies-{mode}", workload={"factory": f"test_ps_faults:dies_on_rank{dead}_at_step3"},
                          train={"optimizer": "sgd", "lr": 0.1, "steps": 8},
                          backend=ps(2, mode, timeout_s=30.0, **extra))
    assert [w["rank"] for w in summary["lost_workers"]] == [dead]
    assert "exited with code 3" in summary["lost_workers"][0]["error"]
    assert summary["steps"] == 8 and [m["rank"] for m in summary["memory"]["per_rank"]] == [1 - dead]
    state = torch.load(out / "model.pt", weights_only=True)
    build_workload(from_dict(TINY_GPT)).model.load_state_dict(state)
    versions = [d["version"] for d in summary["servers_detail"]]
    assert versions == [{"async": 3 + 8, "ssp": 3 + 8, "geo": 8 // 2}[mode]]   # every surviving push landed


def test_sync_goes_on_without_a_dead_worker(tmp_path):
    """Its rounds from then on are the mean of the surviving worker's gradients; every round is applied."""
    summary, out = launch(tmp_path, "sync-dies", workload={"factory": "test_ps_faults:dies_on_rank1_at_step3"},
                          train={"optimizer": "sgd", "steps": 8}, backend=ps(2, timeout_s=3.0))
    assert [w["rank"] for w in summary["lost_workers"]] == [1] and "exited with code 3" in summary["lost_workers"][0]["error"]
    assert summary["steps"] == 8 and [d["version"] for d in summary["servers_detail"]] == [8]
    assert [d["lost"] for d in summary["servers_detail"]] == [[1]]


def test_sync_goes_on_without_a_hung_worker_after_timeout(tmp_path):
    """The round waits backend.timeout_s for the hung worker, then goes on without it; the launcher kills the
    hung process once the survivor has finished and it has made no progress (psarch.launch.stalls)."""
    summary, out = launch(tmp_path, "sync-hangs", workload={"factory": "test_ps_faults:hangs_on_rank1_at_step3"},
                          train={"optimizer": "sgd", "steps": 8}, backend=ps(2, timeout_s=3.0))
    assert [w["rank"] for w in summary["lost_workers"]] == [1] and "Stalled" in summary["lost_workers"][0]["error"]
    assert summary["steps"] == 8 and [d["version"] for d in summary["servers_detail"]] == [8]
    rank0 = [json.loads(x) for x in (out / "ranks" / "rank0.jsonl").read_text().splitlines()]
    assert rank0[3]["step_time_s"] >= 3.0   # the round of step 3 waited the whole timeout for worker 1


def test_standalone_server_serves_workers_that_find_it_through_the_config(tmp_path):
    """`psarch server` (its own process, port 0 = any free port) + a worker given backend.server_addresses."""
    import subprocess
    import sys

    toml = tmp_path / "remote.toml"
    toml.write_text('seed = 3\n[workload]\nseq_len = 8\n[workload.gpt]\nn_layer = 1\nn_embd = 16\nn_head = 2\n'
                    '[workload.markov]\nvocab_size = 16\nbranching = 3\n'
                    '[train]\nsteps = 4\nglobal_batch = 12\noptimizer = "sgd"\nlr = 0.1\nlog_every = 100\n'
                    '[backend]\nkind = "ps"\nmode = "async"\ntimeout_s = 20.0\n'
                    f'keys = "{keygen(tmp_path / "keys", 1, 1)}"\n')   # `psarch keygen`: the server needs keys
    proc = subprocess.Popen([sys.executable, "-m", "psarch.cli", "server", str(toml), "--index", "0", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on tcp://127.0.0.1:" in line, line + proc.stderr.read()
        address = line.split()[-1]
        summary = psarch.run(toml, tmp_path / "remote", overrides=[f'backend.server_addresses=["{address}"]'],
                             echo=False)
        assert summary["steps"] == 4
        out, err = proc.communicate(timeout=scaled(30))
        assert proc.returncode == 0, err
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["version"] == 4 and stats["received"] == summary["traffic"]["per_rank"][0]["sent"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_standalone_server_goes_on_without_a_silent_worker_and_exits(tmp_path, mode):
    """Across machines no launcher tells a `psarch server` that a worker died: after backend.timeout_s
    without a message from it the server counts it lost, the survivor finishes (in ssp without waiting
    for the timeout to fail the run), and the server exits by itself once every worker is done or lost."""
    import subprocess
    import sys

    toml = tmp_path / "remote.toml"
    toml.write_text('seed = 3\n[workload]\nfactory = "test_ps_faults:dies_on_rank1_at_step3_rank0_pauses_at_step5"\n'
                    '[train]\nsteps = 8\nglobal_batch = 12\noptimizer = "sgd"\nlr = 0.1\nlog_every = 100\n'
                    f'[backend]\nkind = "ps"\nworld_size = 2\nmode = "{mode}"\n'
                    + ('staleness_bound = 1\n' if mode == "ssp" else '')   # an option async does not read is refused
                    + f'timeout_s = 3.0\nkeys = "{keygen(tmp_path / "keys", 2, 1)}"\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "psarch.cli", "server", str(toml), "--index", "0", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on tcp://127.0.0.1:" in line, line + proc.stderr.read()
        summary = psarch.run(toml, tmp_path / "remote", echo=False,
                             overrides=[f'backend.server_addresses=["{line.split()[-1]}"]'])
        assert summary["steps"] == 8 and [w["rank"] for w in summary["lost_workers"]] == [1]
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=scaled(30))   # no `done` will ever come from worker 1
        assert proc.returncode == 0, err
        assert time.monotonic() - t0 < scaled(30)
        assert "worker 1 lost: no message from it for more than 3 s (backend.timeout_s)" in err
        assert "worker 0 lost" not in err
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["lost"] == [1] and stats["failure"] is None and stats["version"] == 3 + 8
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
