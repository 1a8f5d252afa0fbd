"""LoRA and frozen fine-tuning on the parameter server `--from` a base model's checkpoint
(psarch/checkpoint/finetune.py): the servers build their range of what trains from the checkpoint (the adapters as
LoRA initialises them, a frozen config's trainable base parameters as the checkpoint holds them:
psarch/ps/layout.py's initial_flat), the workers load the frozen base weights into their models. Sync at N = 2
with 1 and 2 servers ends where `single` does from the same checkpoint (SGD, parity.SGD_ATOL); the servers hold
and the wire carries only the parameters that train; a resumed fine-tune finds its base checkpoint again and
ends bit for bit where the uninterrupted one does; async and GEO start from the same weights."""
from __future__ import annotations

import json

import pytest
import torch

from parity import OPTIMIZERS, SGD_ATOL, assert_same_model, config
from psarch import registry
from psarch.checkpoint.reader import consolidated_state_dict
from psarch.config import ConfigError, from_dict
from psarch.launch.ranks import run
from psarch.workload import build_workload

LORA = dict(OPTIMIZERS["sgd"], lora_rank=2, lora_alpha=4.0, steps=4)
FROZEN = dict(OPTIMIZERS["sgd"], trainable=["head.weight", "blocks.*.mlp.*"], steps=4)
TRAINS = {"lora": LORA, "frozen": FROZEN}
N = 2


def _ps(**backend) -> dict:
    return dict({"kind": "ps", "mode": "sync", "world_size": N, "servers": 1}, **backend)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A full (no adapters) single run of 3 SGD steps, checkpointed at step 3, and `single`'s fine-tunes from it."""
    out = tmp_path_factory.mktemp("pslorafrom")
    run(from_dict(config("base", train=dict(OPTIMIZERS["sgd"], steps=3, checkpoint_every=3))), out / "base",
        echo=False)
    ckpt = out / "base" / "checkpoints" / "step_000003"
    for name, train in TRAINS.items():
        run(from_dict(config(f"single-{name}", train=train)), out / f"single-{name}", echo=False, start=ckpt)
    return out, ckpt


def _model(path):
    return torch.load(path / "model.pt", weights_only=True)


def _first_losses(run_dir) -> dict[int, float]:
    """Each rank's loss at step 0 (on its shard of the global batch)."""
    rows = [json.loads(line) for r in range(N) for line in (run_dir / "ranks" / f"rank{r}.jsonl").read_text().splitlines()]
    return {r["rank"]: r["loss"] for r in rows if r["step"] == 0}


def _base_losses(ckpt, cfg) -> dict[int, float]:
    """The base model (the checkpoint's weights) on each rank's shard of step 0's batch: B = 0 leaves a LoRA model's
    loss so."""
    plain = from_dict(config("plain", train=OPTIMIZERS["sgd"]))
    w = build_workload(plain)
    w.model.load_state_dict(dict(consolidated_state_dict(ckpt)))
    spec = registry.spec_of(cfg)
    with torch.no_grad():
        return {r: float(w.loss_fn(w.model, w.batch(0, *spec.batch_shard(cfg, r, N)))) for r in range(N)}


@pytest.mark.parametrize("name, servers", [("lora", 1), ("lora", 2), ("frozen", 2)])
def test_sync_ps_from_the_base_checkpoint_equals_single(base, name, servers):
    out, ckpt = base
    train = TRAINS[name]
    cfg = from_dict(config(f"ps-{name}-{servers}", train=train, backend=_ps(servers=servers)))
    s = run(cfg, out / cfg.name, echo=False, start=ckpt)
    a, b = _model(out / cfg.name), _model(out / f"single-{name}")
    assert_same_model(a, b, f"ps sync ({servers} servers) vs single, {name} from the base checkpoint", rtol=0,
                      atol=SGD_ATOL)
    print(f"{cfg.name}: max |ps - single| = {max(float((a[k] - b[k]).abs().max()) for k in a):.3g}")
    weights = dict(consolidated_state_dict(ckpt))
    model = build_workload(cfg, device="meta").model
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    for k, w in weights.items():   # the frozen weights are the checkpoint's, not the seed's
        assert k in trains or torch.equal(a[k], w), k
    # only what trains lives on the servers and moves: Φ is the adapters (or the trainable set), 4Φ a push
    phi = sum(p.numel() for n, p in model.named_parameters() if n in trains)
    frozen = sum(p.numel() for n, p in model.named_parameters() if n not in trains)
    assert s["params"] == phi and s["frozen_params"] == frozen and 4 * frozen > 4096   # more than the slack below
    assert sum(m["held"] for m in s["memory"]["servers"]) == phi
    headers = 128 * servers   # a message to each server a step, each way
    for t in s["traffic"]["per_rank"]:
        assert 4 * phi < t["sent_per_step"] <= 4 * phi + headers
        assert 4 * phi < t["received_per_step"] <= 4 * phi + headers
    received = sum(x["received"] for x in s["traffic"]["servers"])
    assert N * train["steps"] * 4 * phi < received < N * (train["steps"] * (4 * phi + headers) + 4096)
    if name == "lora":   # B = 0: the first loss is the base model's
        assert _first_losses(out / cfg.name) == pytest.approx(_base_losses(ckpt, cfg), rel=1e-6)


@pytest.mark.parametrize("mode", ["async", "geo"])
def test_other_modes_start_from_the_base_weights(base, mode):
    """Async and GEO (with its barrier: deterministic) start from the checkpoint: the first loss is the base
    model's (async: the first worker's to push, which pulled before any push; the other may pull after it), the
    frozen weights stay the checkpoint's, and the adapters train."""
    out, ckpt = base
    backend = _ps(mode=mode, **({"k_steps": 2, "geo_barrier": True} if mode == "geo" else {}))
    cfg = from_dict(config(f"ps-{mode}", train=LORA, backend=backend))
    run(cfg, out / cfg.name, echo=False, start=ckpt)
    first, base_losses = _first_losses(out / cfg.name), _base_losses(ckpt, cfg)
    same = [r for r in range(N) if first[r] == pytest.approx(base_losses[r], rel=1e-6)]
    assert same == list(range(N)) if mode == "geo" else same, (first, base_losses)
    tuned = _model(out / cfg.name)
    for k, w in consolidated_state_dict(ckpt):
        assert torch.equal(tuned[k], w), k
    assert any(bool(tuned[k].abs().sum()) for k in tuned if k.endswith("lora_B"))


def test_a_resumed_ps_fine_tune_keeps_the_base_weights(base, tmp_path):
    """Its checkpoints hold the adapters and their optimizer state (servers) and the workers' records: the frozen
    weights come again from the base checkpoint (config started_from), so the resumed run ends bit for bit where
    the uninterrupted one does."""
    out, ckpt = base
    backend = _ps(servers=2)
    run(from_dict(config("straight", train=LORA, backend=backend)), tmp_path / "straight", echo=False, start=ckpt)
    half = dict(LORA, checkpoint_every=2)
    run(from_dict(config("half", train=dict(half, steps=2), backend=backend)), tmp_path / "half", echo=False,
        start=ckpt)
    stored = torch.load(tmp_path / "half" / "model.pt", weights_only=True)
    for k, w in consolidated_state_dict(ckpt):   # the half run's model too: the base's frozen weights
        assert torch.equal(stored[k], w), k
    run(from_dict(config("half", train=half, backend=backend)), tmp_path / "half", echo=False, resume=True)
    a, b = _model(tmp_path / "straight"), _model(tmp_path / "half")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_replicas_start_from_the_base_checkpoint(base):
    """Chain replication: every holder of a partition builds it from the base checkpoint, as a run from step 0
    builds it from the seed (a checkpoint of the run's own has no replicas to restore, refused)."""
    out, ckpt = base
    cfg = from_dict(config("ps-replicas", train=LORA, backend=_ps(servers=2, replicas=1)))
    s = run(cfg, out / cfg.name, echo=False, start=ckpt)
    assert s["replication"]["copies_identical"]
    assert_same_model(_model(out / cfg.name), _model(out / "single-lora"), "ps replicas vs single", rtol=0,
                      atol=SGD_ATOL)


def test_what_stays_unsupported_is_refused_in_one_line(base, tmp_path):
    out, ckpt = base
    remote = from_dict(config("remote", train=LORA, backend=_ps(server_addresses=["tcp://127.0.0.1:1"])))
    with pytest.raises(ConfigError, match=r"^backend.server_addresses: servers started with `psarch server` have no "
                                          r"run folder to write or read checkpoints in [^\n]*$"):
        run(remote, tmp_path / "remote", echo=False, start=ckpt)
    half = from_dict(config("half", train=dict(LORA, steps=2, checkpoint_every=2), backend=_ps()))
    run(half, tmp_path / "half", echo=False)   # from the seed: a fork of a fine-tune from a base is refused earlier
    fork = from_dict(config("fork", train=LORA, backend=_ps(servers=2, replicas=1)))
    with pytest.raises(ConfigError, match=r"^backend.replicas = 1: a run started from a checkpoint [^\n]*$"):
        run(fork, tmp_path / "fork", echo=False, start=tmp_path / "half" / "checkpoints" / "step_000002")
