"""A run's history is never rewritten: `--resume` continues the same run (a change of what it measures is
refused in one line that points to --from), a fork records the checkpoint it started from, and a corrupted
latest checkpoint is named with the newest intact one offered. Single-process runs of a tiny regression."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

import checkpoint_runs as cr
from psarch.checkpoint import Checkpoint
from psarch.checkpoint.start import changed_keys, starting_checkpoint
from psarch.cli import main
from psarch.config import ConfigError, from_dict

TRUNK = {"name": "h", "seed": 1, "workload": {"factory": "factories:regression"},
         "train": {"steps": 6, "global_batch": 4, "optimizer": "adamw", "lr": 0.01, "log_every": 2,
                   "checkpoint_every": 2}}
ALLOWED = ("name, label, out, train.steps, train.log_every, train.checkpoint_every, train.keep_checkpoints, "
           "train.tensorboard, backend.timeout_s, cluster.dilation, faults.kill, faults.pause, faults.restart, "
           "convergence_target")


@pytest.fixture(scope="module")
def trunk(tmp_path_factory) -> tuple[Path, Path]:
    """A finished 6-step run with checkpoints at steps 2, 4 and 6, and its config file."""
    root = tmp_path_factory.mktemp("trunk")
    toml = cr.toml(root / "h.toml", TRUNK)
    assert main(["run", str(toml), "--out", str(root / "h"), "--quiet"]) == 0
    return root / "h", toml


def _copy(trunk: tuple[Path, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(trunk[0], tmp_path / "h"))


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("sets, says", [
    (["train.lr=0.5"], 'train.lr = 0.5 here, 0.01 in the run\'s checkpoint step_000006;'),
    (['backend.kind="ddp"', "backend.world_size=2"],
     'backend.kind = "ddp" here, "single" in the run\'s checkpoint step_000006 (and 1 more);'),
    (["cluster.jitter=0.1"], "cluster.jitter = 0.1 here, 0.0 in the run's checkpoint step_000006;"),
])
def test_resume_refuses_a_change_of_what_the_run_measures(trunk, tmp_path, capsys, sets, says):
    run = _copy(trunk, tmp_path)
    before = (run / "config.json").read_text()
    args = ["run", str(trunk[1]), "--resume", str(run), "--set", "train.steps=8", "--quiet"]
    rc = main(args + [a for s in sets for a in ("--set", s)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"psarch: config error: --resume {run}: {says} a resume continues the same run, so "
                               f"only {ALLOWED} may change. To train on from that state under this config, start a "
                               f"new run: --from {run}/checkpoints/step_000006"], err
    assert (run / "config.json").read_text() == before and _steps(run) == list(range(6))   # untouched


def test_resume_rule_sees_the_issues_examples():
    """ddp N=4 resumed as zero-2 N=2 (its ranks 2-3's rows would go), an emulated run resumed on loopback."""
    base = {"workload": {"factory": "factories:regression"}, "train": {"global_batch": 4}}
    ddp4 = from_dict(dict(base, backend={"kind": "ddp", "world_size": 4})).to_dict()
    zero2 = from_dict(dict(base, backend={"kind": "zero", "stage": 2, "world_size": 2}))
    assert [k for k, _, _ in changed_keys(ddp4, zero2)] == ["backend.kind", "backend.world_size", "backend.stage"]
    emulated = from_dict(dict(base, cluster={"emulate": True, "link_mbps": 100.0})).to_dict()
    loopback = from_dict(base)
    assert changed_keys(emulated, loopback) == [("cluster.emulate", True, False), ("cluster.link_mbps", 100.0, 1000.0)]
    assert changed_keys(loopback.to_dict(), loopback) == []


def test_resume_measures_the_core_and_stretches_the_waits_again():
    """The ranks' checkpoints hold the measured core's rate and the timeouts stretched by D; the config resumed
    asks for the core measured and the waits as written, and is the same run. A core given a rate, or a
    profile, is not."""
    from psarch.cluster.dilation import resolve
    base = {"workload": {"factory": "factories:regression"}, "train": {"global_batch": 4},
            "backend": {"kind": "ps", "world_size": 2}, "cluster": {"emulate": True, "dilation": 20.0}}
    asked = from_dict(base)
    ranks = resolve(asked, echo=False)
    assert ranks.cluster.device == "cpu-core" and ranks.backend.heartbeat_timeout_s == 20 * asked.backend.heartbeat_timeout_s
    assert changed_keys(ranks.to_dict(), asked) == []
    given = from_dict(dict(base, cluster={**base["cluster"], "device": "cpu-core", "device_tflops": 0.5}))
    assert [k for k, _, _ in changed_keys(ranks.to_dict(), given)] == ["cluster.device_tflops"]
    v100 = from_dict(dict(base, cluster={**base["cluster"], "device": "v100"}))
    assert [k for k, _, _ in changed_keys(ranks.to_dict(), v100)] == ["cluster.device", "cluster.device_tflops"]


def test_resume_takes_the_options_that_change_only_how_long_and_what_is_printed(trunk, tmp_path, capsys):
    run = _copy(trunk, tmp_path)
    sets = ["train.steps=8", "train.log_every=1", "train.checkpoint_every=4", "train.keep_checkpoints=2", 'name="h2"',
            "convergence_target=0.2"]
    assert main(["run", str(trunk[1]), "--resume", str(run), "--quiet"] + [a for s in sets for a in ("--set", s)]) == 0
    assert _steps(run) == list(range(8))
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 8
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000006", "step_000008"]


def test_a_corrupted_latest_checkpoint_is_named_and_the_newest_intact_one_offered(trunk, tmp_path, capsys):
    run = _copy(trunk, tmp_path)
    for step in (4, 6):   # the two newest: step 2's is the newest intact one
        blob = run / "checkpoints" / f"step_00000{step}" / "rank0.bin"
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 1
        blob.write_bytes(bytes(data))
    resume = ["run", str(trunk[1]), "--resume", str(run), "--set", "train.steps=8", "--quiet"]
    assert main(resume) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"psarch: run 'h' failed: {run}/checkpoints/step_000006/rank0.bin: sha256 differs from the "
                   f"metadata's (corrupted); the newest intact checkpoint is step_000002: --resume {run} "
                   f"--checkpoint step_000002 continues from it (its later checkpoints are removed)"], err
    assert main(resume + ["--checkpoint", "step_000002"]) == 0
    assert _steps(run) == list(range(8))   # steps 0, 1 carried; 2..7 run again, each once
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_00000{s}" for s in (2, 4, 6, 8)]
    for step in (4, 6):   # written again by the resumed run: intact
        Checkpoint(run / "checkpoints" / f"step_00000{step}").verify()


def test_checkpoint_names_a_checkpoint_of_a_resumed_run_only(trunk, tmp_path, capsys):
    run = _copy(trunk, tmp_path)
    assert main(["run", str(trunk[1]), "--out", str(tmp_path / "new"), "--checkpoint", "2", "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "psarch: config error: --checkpoint 2: picks the checkpoint of a --resume RUN_DIR; a new run names its "
        "checkpoint folder with --from"]
    assert main(["run", str(trunk[1]), "--resume", str(run), "--checkpoint", "3", "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"psarch: config error: --checkpoint 3: no complete checkpoint step_000003 under {run}/checkpoints; there "
        f"are step_000002, step_000004, step_000006"]


def test_a_fork_records_where_it_started_and_compare_shows_it(trunk, tmp_path, capsys):
    source = trunk[0] / "checkpoints" / "step_000004"
    forked = cr.toml(tmp_path / "fork.toml", dict(TRUNK, name="fork", train=dict(TRUNK["train"], lr=0.05)))
    assert main(["run", str(forked), "--from", str(source), "--out", str(tmp_path / "fork"), "--quiet"]) == 0
    meta = json.loads((source / "metadata.json").read_text())
    digest = hashlib.sha256(json.dumps(meta["config"], sort_keys=True).encode()).hexdigest()
    want = {"path": str(source), "step": 4, "config_sha256": digest}
    assert json.loads((tmp_path / "fork" / "config.json").read_text())["started_from"] == want
    assert json.loads((tmp_path / "fork" / "summary.json").read_text())["started_from"] == want
    # resumed, it is still the run that started there
    assert main(["run", str(forked), "--resume", str(tmp_path / "fork"), "--set", "train.steps=8", "--quiet"]) == 0
    assert json.loads((tmp_path / "fork" / "config.json").read_text())["started_from"] == want
    capsys.readouterr()
    assert main(["compare", str(trunk[0]), str(tmp_path / "fork"), "--out", str(tmp_path / "cmp")]) == 0
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert f"- fork started from {source} (step 4, config sha256 {digest[:12]})" in report.splitlines()
    assert "- h started from" not in report


def test_started_from_is_recorded_never_set(tmp_path, capsys):
    toml = cr.toml(tmp_path / "h.toml", TRUNK)
    assert main(["run", str(toml), "--set", 'started_from={path="x", step=1}', "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == ('psarch: config error: started_from = {"path": "x", "step": 1}: '
                                               'psarch records it in config.json; it is not a setting (remove it)')


def test_resume_refuses_a_checkpoint_without_a_lost_workers_part(trunk, tmp_path):
    """A PS worker lost before a checkpoint wrote no part of it: resuming would bring it back, which the run
    never did. (The checkpoint here is the trunk's, relabelled as a 2-worker PS run's that lacks rank1.)"""
    cfg = from_dict({"workload": {"factory": "factories:regression"}, "backend": {"kind": "ps", "world_size": 2},
                     "train": dict(TRUNK["train"], steps=8)})
    run = tmp_path / "ps"
    shutil.copytree(trunk[0] / "checkpoints" / "step_000004", run / "checkpoints" / "step_000004")
    meta_path = run / "checkpoints" / "step_000004" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["config"] = json.loads(json.dumps(cfg.to_dict()))
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as e:
        starting_checkpoint(cfg, run, resume=True, start=None)
    assert str(e.value) == (f"--resume {run}: the checkpoint step_000004 holds no part of worker 1 (lost before it "
                            f"was written); resuming would bring it back from the servers' model, which the run "
                            f"never did. Start a new run that does: --from {run}/checkpoints/step_000004")


def test_resume_removes_what_a_kill_mid_write_left(trunk, tmp_path):
    """A kill mid-write leaves .tmp_step_K with the parts written so far; a resumed PS run merges the worker parts
    it finds there, so a lost worker's part from the killed attempt would come back. A resume removes them."""
    run = _copy(trunk, tmp_path)
    left = run / "checkpoints" / ".tmp_step_000010"
    left.mkdir()
    (left / "rank1.json").write_text("{}")
    assert main(["run", str(trunk[1]), "--resume", str(run), "--set", "train.steps=8", "--quiet"]) == 0
    assert not left.exists() and _steps(run) == list(range(8))


def test_a_resume_says_which_checkpoint_and_step_it_continues_from(trunk, tmp_path, capsys):
    run = _copy(trunk, tmp_path)
    assert main(["run", str(trunk[1]), "--resume", str(run), "--set", "train.steps=8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"psarch: resumed from {run}/checkpoints/step_000006 at step 6", out[:3]


@pytest.mark.parametrize("flag, where, says", [
    ("--resume", "missing", "no such run folder"),
    ("--resume", "empty", "no complete checkpoint under {path}/checkpoints (a run writes them with "
                          "train.checkpoint_every)"),
    ("--from", "missing", "no such folder"),
    ("--from", "empty", "not a checkpoint folder (no metadata.json; a run's checkpoints are its "
                        "checkpoints/step_* folders)"),
])
def test_a_wrong_start_path_is_a_config_error_naming_the_flag(trunk, tmp_path, capsys, flag, where, says):
    path = tmp_path / where
    if where == "empty":
        path.mkdir()
    args = ["run", str(trunk[1]), flag, str(path), "--out", str(tmp_path / "new"), "--quiet"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"psarch: config error: {flag} {path}: {says.format(path=path)}"]
