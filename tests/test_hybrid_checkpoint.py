"""The hybrid's checkpoints (backend.embeddings = "ps" on ddp and ZeRO-1/2/3: the tables' rows on 2 PS servers, the
dense part on 2 ranks; collective/ps_tables.py): each rank writes its dense part, each server its shard of the tables'
rows and their optimizer state (psarch/ps/server/snapshots.py, after the step's round), rank 0 merges and renames.
Resumed from step 3 the run ends with the uninterrupted run's model.pt, bit for bit (SGD, Adagrad and AdamW, whose
state on the ranks and on the servers must come back; dlrm/clicks as tests/test_hybrid.py); so does a run whose
rank or server was SIGKILLed after a checkpoint (faults.kill), resumed with --resume or restarted by the launcher;
a world restarted at N - 1 (faults.restart = "shrink") equals a fork at N - 1 from the checkpoint, bit for bit; the
checkpoint forks onto `single` and onto 3 servers; one without a server's part is refused in one line naming it; with
top-k on the dense layers the ranks' error feedback comes back too."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import psarch
from parity import SGD_ATOL, assert_same_model, config
from psarch.checkpoint.reader import CheckpointError, consolidated_state_dict
from psarch.config import from_dict
from psarch.launch.ranks import run
from psarch.errors import RunError
from psarch.workload import build_workload
from test_ps_rows import ROWS_DLRM

SGD = {"optimizer": "sgd", "lr": 0.5, "steps": 6, "checkpoint_every": 3}
OPTIMIZERS = {"sgd": {}, "adagrad": {"optimizer": "adagrad", "lr": 0.1}, "adamw": {"optimizer": "adamw", "lr": 0.01}}
HYBRIDS = {"ddp": {"kind": "ddp", "comm": "ring"}, "zero1": {"kind": "zero", "stage": 1, "comm": "ring"},
           "zero2": {"kind": "zero", "stage": 2, "comm": "ring"}, "zero3": {"kind": "zero", "stage": 3, "comm": "ring"}}
# (hybrid, optimizer) resumed: Adagrad's sums and AdamW's moments and steps, on the ranks and on the servers
RESUMED = [("ddp", "sgd"), ("zero1", "sgd"), ("ddp", "adagrad"), ("ddp", "adamw"), ("zero2", "adamw"),
           ("zero3", "adagrad")]


def _cfg(name: str, kind: str, n: int = 2, train: dict | None = None, opt: str = "sgd", **sections) -> psarch.Config:
    backend = dict(HYBRIDS[kind], embeddings="ps", servers=2, world_size=n, timeout_s=30.0)
    train = dict(SGD, **OPTIMIZERS[opt], **(train or {}))
    return from_dict(config(name, base=ROWS_DLRM, train=train, backend=backend, **sections))


def _model(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Each hybrid's uninterrupted run of 6 steps, checkpointed at steps 3 and 6, run once when first asked for."""
    out, runs = tmp_path_factory.mktemp("hybridckpt"), {}

    def get(kind: str, opt: str = "sgd") -> Path:
        if (kind, opt) not in runs:
            run(_cfg(kind, kind, opt=opt), out / f"{kind}-{opt}", echo=False)
            runs[kind, opt] = out / f"{kind}-{opt}"
        return runs[kind, opt]
    return get


@pytest.mark.parametrize("kind, opt", RESUMED)
def test_a_resume_from_step_3_ends_with_the_straight_model(straight, tmp_path, kind, opt):
    full = straight(kind, opt)
    ckpt = full / "checkpoints" / "step_000003"
    # the servers' parts are in it: every table's rows, from both servers, as trained to step 3 (not the seed's),
    # with the optimizer's state the ranks keep for the dense part (Adagrad's sum, AdamW's moments)
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert {"server0.bin", "server1.bin", "rank0.bin", "rank1.bin"} <= set(meta["files"])
    dense = {f["key"] for f in meta["fragments"] if f["file"] == "rank0.bin"}
    assert len(dense) == {"sgd": 1, "adagrad": 2, "adamw": 3}[opt]
    assert all(dense <= {f["key"] for f in meta["fragments"] if f["file"] == f"server{i}.bin"} for i in range(2))
    stored = dict(consolidated_state_dict(ckpt))
    init = build_workload(from_dict(ROWS_DLRM)).model.state_dict()
    tables = [k for k in init if k.startswith("tables.")]
    assert tables and all(stored[k].shape == init[k].shape and not torch.equal(stored[k], init[k]) for k in tables)
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    summary = run(_cfg(kind, kind, opt=opt), resumed, echo=False, resume=True, pick="3")
    assert summary["status"] == "finished"
    assert _same(_model(resumed), _model(full))
    assert _steps(resumed) == list(range(6))
    # the resumed run's own checkpoint at step 6 holds the same rows as the straight run's
    assert _same(dict(consolidated_state_dict(resumed / "checkpoints" / "step_000006")),
                 dict(consolidated_state_dict(full / "checkpoints" / "step_000006")))


@pytest.mark.parametrize("victim", ["worker 1", "server 1"])
def test_a_run_killed_after_a_checkpoint_resumes_to_the_straight_model(straight, tmp_path, victim):
    """SIGKILL as step 5 begins (checkpoint 3 written): the run fails; --resume (faults removed) continues from
    step 3, its servers restoring their rows, to the uninterrupted run's model, with every step's metrics once."""
    out = tmp_path / "killed"
    with pytest.raises(RunError):
        run(_cfg("ddp", "ddp", faults={"kill": [{"node": victim, "step": 5}]}), out, echo=False)
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000003"]
    run(_cfg("ddp", "ddp"), out, echo=False, resume=True)
    assert _same(_model(out), _model(straight("ddp")))
    assert _steps(out) == list(range(6))


def test_a_world_restarted_after_a_server_is_killed_ends_with_the_straight_model(straight, tmp_path):
    """faults.restart = "replace": the launcher starts ranks and servers again from checkpoint 3."""
    out = tmp_path / "replaced"
    summary = run(_cfg("ddp", "zero1", faults={"kill": [{"node": "server 0", "step": 4}], "restart": "replace"}),
                  out, echo=False)
    [restart] = summary["restarts"]
    assert restart["from_step"] == 3 and summary["status"] == "finished"
    assert _same(_model(out), _model(straight("zero1")))


def test_a_shrunk_world_equals_a_fork_at_n_minus_1(tmp_path):
    """Worker 2 of 3 killed as step 5 begins: the world restarts at N = 2 from checkpoint 3 (the servers' rows dealt
    by key mod servers, which N does not change) and ends, bit for bit, as a fork at N = 2 from that checkpoint."""
    full = tmp_path / "full"
    run(_cfg("full", "ddp", n=3), full, echo=False)
    fork = tmp_path / "fork"
    run(_cfg("fork", "ddp", n=2), fork, echo=False, start=full / "checkpoints" / "step_000003")
    out = tmp_path / "shrunk"
    summary = run(_cfg("shrunk", "ddp", n=3, faults={"kill": [{"node": "worker 2", "step": 5}], "restart": "shrink"}),
                  out, echo=False)
    [restart] = summary["restarts"]
    assert restart["world_size"] == 2 and restart["from_step"] == 3 and summary["world_size"] == 2
    assert _same(_model(out), _model(fork))
    assert not _same(_model(out), _model(full))


def test_a_hybrid_checkpoint_forks_onto_single_and_onto_3_servers(straight, tmp_path):
    """--from step 3: `single` reads the tables from the servers' strided parts, a hybrid with 3 servers deals them
    again by key mod 3; both end within SGD's parity tolerance of the straight hybrid run (the hybrid equals single)."""
    ckpt = straight("ddp") / "checkpoints" / "step_000003"
    run(from_dict(config("single", base=ROWS_DLRM, train=SGD)), tmp_path / "single", echo=False, start=ckpt)
    cfg = from_dict(config("three", base=ROWS_DLRM, train=SGD, backend=dict(
        HYBRIDS["ddp"], embeddings="ps", servers=3, world_size=2, timeout_s=30.0)))
    run(cfg, tmp_path / "three", echo=False, start=ckpt)
    for name in ("single", "three"):
        assert_same_model(_model(tmp_path / name), _model(straight("ddp")), f"{name} from step 3 vs straight",
                          rtol=0, atol=SGD_ATOL)
    stored = dict(consolidated_state_dict(ckpt))
    assert not torch.equal(_model(tmp_path / "three")["tables.0.weight"], stored["tables.0.weight"])   # it trained on


def _drop_server(ckpt: Path, index: int) -> None:
    """The checkpoint as if server `index` had written no part: its file and fragments gone from the metadata."""
    meta = json.loads((ckpt / "metadata.json").read_text())
    name = f"server{index}.bin"
    del meta["files"][name]
    meta["fragments"] = [f for f in meta["fragments"] if f["file"] != name]
    (ckpt / "metadata.json").write_text(json.dumps(meta))
    (ckpt / name).unlink()


def test_a_checkpoint_without_a_servers_part_is_refused_in_one_line(straight, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(straight("ddp") / "checkpoints" / "step_000003", src)
    _drop_server(src, 1)
    with pytest.raises(CheckpointError, match=r"^--resume/--from .*src: the checkpoint src holds no part of server\(s\) "
                                              r"1 \(their shards of the tables' rows\)") as e:
        run(_cfg("fork", "ddp"), tmp_path / "fork", echo=False, start=src)
    assert "\n" not in str(e.value)
    # a checkpoint of another backend must hold the tables whole too
    meta = json.loads((src / "metadata.json").read_text())
    meta["config"]["backend"]["embeddings"] = "dense"
    (src / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"holds 4000 of 8000 elements of tables\.\d\.weight's rows") as e:
        run(_cfg("fork", "ddp"), tmp_path / "fork", echo=False, start=src)
    assert "\n" not in str(e.value)


def test_a_compressed_hybrid_resumes_with_its_error_feedback(tmp_path):
    """Top-k on the dense layers (ddp writes each rank's error feedback into its part: collective/ddp.py) beside the
    servers' rows: the checkpoint at step 3 holds both ranks' error feedback, and resumed from it the run ends with
    the uninterrupted run's model, bit for bit (a lost error feedback would change the steps after 3)."""
    from collective.ddp import error_key

    topk = {"compression": "topk", "topk_ratio": 0.25}
    full = tmp_path / "full"
    run(_cfg("topk", "ddp", train=topk), full, echo=False)
    meta = json.loads((full / "checkpoints" / "step_000003" / "metadata.json").read_text())
    assert {error_key(0), error_key(1)} <= {f["key"] for f in meta["fragments"]}
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    summary = run(_cfg("topk", "ddp", train=topk), resumed, echo=False, resume=True, pick="3")
    assert summary["status"] == "finished"
    assert _same(_model(resumed), _model(full))
    assert _steps(resumed) == list(range(6))
