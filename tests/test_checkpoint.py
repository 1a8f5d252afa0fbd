"""Checkpoints (psarch.checkpoint): bit-exact resume, resharding onto other backends and world sizes,
and refusal of a checkpoint that is corrupted or does not fit the model.

Bit-exact means equal bit for bit: a resumed run does the same arithmetic on the same state and data as
the straight run. A fork onto another layout or world size changes only the order gradients are summed
in, so it is held to tests/parity.py's tolerance against a single-process continuation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import checkpoint_runs as cr
import parity
from dist_utils import run_ranks
from psarch import checkpoint
from psarch.cli import main
from psarch.config import from_dict
from psarch.dist import DistContext
from psarch.ps.services import start_services
from psarch.launch.runner import run_rank
from timing import scaled


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    results = {}
    results[4] = run_ranks(cr.world4, 4, str(out), timeout=scaled(300))
    # the ps fork's servers start from the N=4 checkpoint, so only once it is written
    servers = start_services(from_dict(cr.to_ps2()), None, threads=True, start=out / "z3n4" / "step_000003")
    try:
        results[2] = run_ranks(cr.world2, 2, str(out), servers.info, timeout=scaled(300))
    finally:
        servers.stop()
    results[3] = run_ranks(cr.world3, 3, str(out), timeout=scaled(300))
    return out, results


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", cr.RESUMED)
def test_resume_is_bit_exact(runs, name):
    out, results = runs
    straight, resumed = torch.load(out / f"{name}.pt"), torch.load(out / f"{name}-resumed.pt")
    assert _bitwise_equal(straight, resumed), name
    for rank in (0, 1):  # the same losses, skips and loss scales, and the rows before the checkpoint carried on
        r = results[2][rank][name]
        assert [x["step"] for x in r["resumed"]] == list(range(6))
        assert r["resumed"] == r["straight"], (name, rank)
    if name.endswith("fp16"):  # the scaler's state mattered: the overflow at step 3 halved the scale
        assert [x["loss_scale"] for x in results[2][0][name]["straight"]][2:4] == [65536.0, 32768.0]


def test_zero3_n4_continues_as_ddp_n2_as_ps_sync_and_as_single(runs):
    out, _ = runs
    reference = cr.single(out, "from-z3n4", out / "z3n4" / "step_000003")
    parity.assert_same_model(torch.load(out / "z3n4-to-ddp-ring2.pt"), reference, "zero-3 N=4 -> ddp N=2")
    parity.assert_same_model(torch.load(out / "z3n4-to-torch_fsdp2.pt"), reference, "zero-3 N=4 -> torch_fsdp N=2")
    parity.assert_same_model(torch.load(out / "z3n4-to-ps2.pt"), reference, "zero-3 N=4 -> ps sync, 2 servers")
    parity.assert_same_model(torch.load(out / "z3n4.pt"), reference, "zero-3 N=4 straight vs -> single")


def test_torch_fsdp_n2_continues_as_single(runs):
    out, _ = runs
    reference = cr.single(out, "from-fsdp2", out / "torch_fsdp-fp32" / "checkpoints" / "step_000003")
    parity.assert_same_model(torch.load(out / "torch_fsdp-fp32.pt"), reference, "torch_fsdp N=2 -> single")


def test_zero1_n2_continues_as_zero3_n3(runs):
    out, _ = runs
    reference = cr.single(out, "from-z1n2", out / "zero1-fp32" / "checkpoints" / "step_000003")
    parity.assert_same_model(torch.load(out / "z1n2-to-z3n3.pt"), reference, "zero-1 N=2 -> zero-3 N=3")


def test_each_zero_rank_writes_its_own_shard(runs):
    out, _ = runs
    meta = json.loads((out / "z3n4" / "step_000003" / "metadata.json").read_text())
    assert sorted(meta["files"]) == [f"rank{r}.bin" for r in range(4)]
    sizes = [info["bytes"] for info in meta["files"].values()]
    params = sum(p["numel"] for p in meta["params"].values())
    # param + exp_avg + exp_avg_sq in fp32 over the model, split four ways (padding is not written)
    assert sum(sizes) == 3 * 4 * params and max(sizes) < 3 * 4 * params / 4 * 1.5


def test_consolidated_state_dict_is_the_model(runs):
    out, _ = runs
    state = dict(checkpoint.consolidated_state_dict(out / "z3n4" / "step_000006"))
    assert _bitwise_equal(state, torch.load(out / "z3n4.pt"))
    first = next(iter(checkpoint.consolidated_state_dict(out / "z3n4" / "step_000006")))
    assert first[0] == "embed.weight"   # the model's order, one parameter at a time


# ---- single process: the CLI, crash recovery, bad checkpoints


@pytest.mark.parametrize("precision, optimizer", [("fp32", "adamw"), ("fp16", "sgd"), ("fp32", "adagrad")])
def test_single_resume_is_bit_exact(tmp_path, precision, optimizer):
    data = cr.config(f"single-{precision}", precision, {"kind": "single"}, 1, steps=6, checkpoint_every=3)
    data["train"].update(optimizer=optimizer)   # adagrad: its `sum` state and step count
    straight = run_rank(from_dict(data), DistContext(), echo=False, checkpoints=tmp_path)
    resumed = run_rank(from_dict(data), DistContext(), echo=False, start=tmp_path / "step_000003", resume=True)
    assert _bitwise_equal(straight.model_state, resumed.model_state)
    keys = ("step", "loss", "skipped", "loss_scale")
    assert [[r[k] for k in keys] for r in resumed.steps] == [[r[k] for k in keys] for r in straight.steps]


def test_an_unfinished_checkpoint_is_never_picked(tmp_path):
    root = tmp_path / "checkpoints"
    data = cr.regression("keep", steps=6, keep_checkpoints=2)
    run_rank(from_dict(data), DistContext(), echo=False, checkpoints=root)
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000006"]   # keep_checkpoints = 2
    (root / ".tmp_step_000008").mkdir()               # a kill mid-write leaves this
    (root / ".tmp_step_000008" / "rank0.bin").write_bytes(b"\0" * 8)
    (root / "step_000010").mkdir()                    # no metadata: never complete
    assert checkpoint.latest_complete(root).name == "step_000006"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A tiny GPT checkpoint at step 2."""
    out = tmp_path_factory.mktemp("written")
    data = parity.config("w", train=dict(parity.OPTIMIZERS["adamw"], steps=2, checkpoint_every=2))
    run_rank(from_dict(data), DistContext(), echo=False, checkpoints=out)
    return out / "step_000002", data


def _fork(tmp_path: Path, ckpt: Path, data: dict, capsys) -> tuple[int, str]:
    cfg = cr.toml(tmp_path / "fork.toml", dict(data, train=dict(data["train"], steps=4)))
    rc = main(["run", str(cfg), "--from", str(ckpt), "--out", str(tmp_path / "fork"), "--quiet"])
    return rc, capsys.readouterr().err


def test_fork_continues_the_step_numbering(tmp_path, written, capsys):
    ckpt, data = written
    rc, err = _fork(tmp_path, ckpt, data, capsys)
    assert rc == 0, err
    steps = [json.loads(line)["step"] for line in (tmp_path / "fork" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3]


@pytest.mark.parametrize("change, says", [
    ({"gpt": {"n_layer": 1, "n_embd": 8, "n_head": 2}}, "parameter 'embed.weight' has shape [16, 8]"),
    ({"factory": "factories:regression"}, "the model's parameter 'net.0.weight' is not in the checkpoint"),
])
def test_a_checkpoint_of_another_model_stops_naming_the_first_mismatch(tmp_path, written, capsys, change, says):
    ckpt, data = written
    workload = change if "factory" in change else dict(data["workload"], **change)   # a factory replaces the rest
    rc, err = _fork(tmp_path, ckpt, dict(data, workload=workload), capsys)
    assert rc == 1 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "fork").exists()   # the run did not start


@pytest.mark.parametrize("damage, says", [("truncate", "truncated"), ("flip", "sha256")])
def test_a_damaged_checkpoint_is_detected_and_the_run_does_not_start(tmp_path, written, capsys, damage, says):
    import shutil

    ckpt, data = written
    copy = tmp_path / "step_000002"
    shutil.copytree(ckpt, copy)
    blob = bytearray((copy / "rank0.bin").read_bytes())
    if damage == "truncate":
        blob = blob[:-4]
    else:
        blob[len(blob) // 2] ^= 1
    (copy / "rank0.bin").write_bytes(bytes(blob))
    rc, err = _fork(tmp_path, copy, data, capsys)
    assert rc == 1 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "fork").exists()


def test_a_backend_without_checkpoints_is_refused_before_the_run(tmp_path, monkeypatch):
    from psarch.config import ConfigError
    from psarch.launch.ranks import run
    from psarch.ps.spec import PSSpec

    monkeypatch.setattr(PSSpec, "checkpoints", False)   # every backend writes them now: pretend one does not
    cfg = from_dict(parity.config("ps", train={"checkpoint_every": 2}, backend={"kind": "ps", "world_size": 2}))
    with pytest.raises(ConfigError, match="backend.kind = 'ps' cannot write or read checkpoints yet"):
        run(cfg, tmp_path / "ps", echo=False)
    assert not (tmp_path / "ps").exists()


def test_a_fork_into_fp16_starts_a_fresh_loss_scaler(written):
    ckpt, data = written   # written in fp32, where no scaler is at work
    forked = dict(data, train=dict(data["train"], steps=3, precision="fp16", checkpoint_every=0))
    record = run_rank(from_dict(forked), DistContext(), echo=False, start=ckpt)
    assert [r["step"] for r in record.steps] == [2] and record.steps[0]["loss_scale"] == 2.0**16


def test_checkpoints_are_ordered_by_step_number_not_name(tmp_path):
    for step in (999_999, 1_000_000):   # by name, step_1000000 sorts first
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / "metadata.json").write_text("{}")
    assert checkpoint.latest_complete(tmp_path).name == "step_1000000"


@pytest.mark.parametrize("field, value, says", [
    ("file", "../../x.bin", "is not a rankN.bin or serverN.bin name"), ("dtype", "Tensor", "dtype 'Tensor'")])
def test_metadata_naming_a_foreign_file_or_dtype_is_refused(tmp_path, written, field, value, says):
    import shutil

    ckpt, _ = written
    copy = tmp_path / "step_000002"
    shutil.copytree(ckpt, copy)
    meta = json.loads((copy / "metadata.json").read_text())
    meta["fragments"][0][field] = value
    if field == "file":
        meta["files"][value] = meta["files"].pop("rank0.bin")
    (copy / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match=says):
        checkpoint.Checkpoint(copy)


def test_a_dlrm_checkpoint_forks(tmp_path, capsys):
    # its click source computes with numpy: only the model may be built on the meta device
    from test_dlrm import TINY_DLRM

    data = dict(TINY_DLRM, name="dlrm", train=dict(TINY_DLRM["train"], steps=2, checkpoint_every=2))
    run_rank(from_dict(data), DistContext(), echo=False, checkpoints=tmp_path / "ck")
    rc, err = _fork(tmp_path, tmp_path / "ck" / "step_000002", data, capsys)
    assert rc == 0, err
    steps = [json.loads(line)["step"] for line in (tmp_path / "fork" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3]


def test_a_resumed_run_that_fails_keeps_the_steps_before_its_checkpoint(tmp_path, monkeypatch):
    data = parity.config("r", workload={"factory": "factories:fails_when_asked"},
                         train=dict(parity.OPTIMIZERS["adamw"], steps=2, checkpoint_every=2))
    assert main(["run", str(cr.toml(tmp_path / "a.toml", data)), "--out", str(tmp_path / "r"), "--quiet"]) == 0
    monkeypatch.setenv("PSARCH_TEST_FAIL_AT", "4")
    longer = dict(data, train=dict(data["train"], steps=6))
    assert main(["run", str(cr.toml(tmp_path / "b.toml", longer)), "--resume", str(tmp_path / "r"), "--quiet"]) == 1
    steps = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]   # the resumed run fails at its third step, step 4


def test_a_fork_drops_the_folders_older_checkpoints_and_keeps_one_it_starts_from(tmp_path, written, capsys):
    """A fork replaces its run folder's checkpoints (a later --resume must not pick an earlier run's); one of
    them that the fork starts from is moved to forked_from/ and recorded as where the fork started."""
    import shutil

    ckpt, data = written
    old = tmp_path / "fork" / "checkpoints" / "step_000009"   # an earlier run's, which a --resume would pick
    shutil.copytree(ckpt, old)
    rc, err = _fork(tmp_path, ckpt, data, capsys)
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "fork" / "checkpoints").iterdir()) == ["step_000004"]
    source = tmp_path / "fork" / "checkpoints" / "step_000004"
    again = ["run", str(tmp_path / "fork.toml"), "--from", str(source), "--out", str(tmp_path / "fork"),
             "--set", "train.steps=5", "--overwrite", "--quiet"]
    rc, err = main(again), capsys.readouterr().err
    assert rc == 0, err
    assert not (tmp_path / "fork" / "checkpoints").exists()   # none written in its one step, none left to --resume
    kept = tmp_path / "fork" / "forked_from" / "step_000004"
    assert (kept / "metadata.json").is_file()
    started = json.loads((tmp_path / "fork" / "config.json").read_text())["started_from"]
    assert started["path"] == str(kept) and started["step"] == 4
    assert json.loads((tmp_path / "fork" / "summary.json").read_text())["started_from"] == started
    steps = [json.loads(line)["step"] for line in (tmp_path / "fork" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4]
