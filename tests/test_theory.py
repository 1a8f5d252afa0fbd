"""`theory.predict` against the formulas, for every backend kind the registry knows (the PyTorch peers
included), and every PS mode; each formula is written out here on its own, not through theory's helpers."""
from __future__ import annotations

import pytest

from psarch import theory
from psarch.registry import kinds

PHI, N, SERVERS = 1000.0, 4, 2


def cfg(kind: str, **backend):
    precision = backend.pop("precision", "fp32")
    ps = {"servers": SERVERS} if kind == "ps" else {}
    return theory.config_for(kind, backend.pop("n", N), precision, "adamw", **ps, **backend)


# kind, backend options -> (params, grads, optimizer, buffers) per rank, worker bytes sent per step, rounds
# fp32 AdamW: 4 bytes per parameter and gradient, K = 8; S = 4 PHI; a ring pass moves (N-1)/N S
S = 4 * PHI
RING = (N - 1) / N * S
# tensor parallelism t = N on config_for's GPT (vocabulary V = 64, seq_len 32, L = 2 blocks of h = 64, MLP 4h),
# global batch N, so one replica: a block has 12h^2 + 13h parameters, of which a rank holds 1/t of the weights and
# of the column-parallel biases (qkv 3h, MLP 4h) and the rest whole (row-parallel biases 2h, LayerNorms 4h); the
# vocabulary's rows of the embedding and head split too, the position embedding and final LayerNorm whole
V, SEQ, L, H = 64, 32, 2, 64
WHOLE = 2 * V * H + SEQ * H + L * (12 * H * H + 13 * H) + 2 * H
HELD = (2 * V * H + L * (12 * H * H + 7 * H)) / N + SEQ * H + L * 6 * H + 2 * H
TOKENS = N * SEQ
ROOT = 2 * V * H + SEQ * H + 2 * H   # the elements outside the blocks
# per step, 4 all-reduces of TOKENS x H fp32 activations per block and 2 more (embedding, head), each 2(t-1)/t of
# the buffer; one all-gather of each rank's 2 x TOKENS fp32 logsumexps and target logits, (t-1) times that
TENSOR_SENT = (4 * L + 2) * 2 * (N - 1) / N * TOKENS * H * 4 + (N - 1) * 2 * TOKENS * 4
CASES = {
    "single": ({"n": 1}, (4 * PHI, 4 * PHI, 8 * PHI, 0), 0.0, 0),
    "ddp": ({}, (4 * PHI, 4 * PHI, 8 * PHI, 0), 2 * RING, 2),
    "torch_ddp": ({}, (4 * PHI, 4 * PHI, 8 * PHI, 0), 2 * RING, 2),
    "zero1": ({"stage": 1}, (4 * PHI, 4 * PHI, 8 * PHI / N, 0), 2 * RING, 2),
    "zero2": ({"stage": 2}, (4 * PHI, 4 * PHI / N, 8 * PHI / N, 0), 2 * RING, 2),
    "zero3": ({"stage": 3}, (4 * PHI / N, 4 * PHI / N, 8 * PHI / N, 0), 3 * RING, 3),
    # ZeroRedundancyOptimizer: ZeRO-1 memory, DDP's all-reduce plus a broadcast of every shard
    "torch_zero": ({}, (4 * PHI, 4 * PHI, 8 * PHI / N, 0), 3 * RING, 3),
    # FSDP2 fully_shard: ZeRO-3, but its root (embeddings, final norm, head: ROOT of WHOLE) kept gathered from
    # forward through backward, all-gathered once
    "torch_fsdp": ({}, (4 * PHI / N, 4 * PHI / N, 8 * PHI / N, 0), (3 - ROOT / WHOLE) * RING, 3),
    # a PS worker holds parameters and gradients; it pushes S and pulls S every step (split over servers)
    "ps-sync": ({"mode": "sync"}, (4 * PHI, 4 * PHI, 0, 0), S, 2),
    "ps-async": ({"mode": "async"}, (4 * PHI, 4 * PHI, 0, 0), S, 2),
    "ps-ssp": ({"mode": "ssp"}, (4 * PHI, 4 * PHI, 0, 0), S, 2),
    # GEO: a local optimizer and the last synced fp32 model; one push and one pull every k_steps steps
    "ps-geo": ({"mode": "geo", "k_steps": 4}, (4 * PHI, 4 * PHI, 8 * PHI, 4 * PHI), S / 4, 2 / 4),
    # one process: the master's model states and N - 1 replicas' parameters and gradients; the master sends the
    # parameters to each replica and receives each replica's gradients, (N - 1) S each way, in 2 phases
    "dp": ({}, (N * 4 * PHI, N * 4 * PHI, 8 * PHI, 0), (N - 1) * S, 2),
    "torch_dp": ({}, (N * 4 * PHI, N * 4 * PHI, 8 * PHI, 0), (N - 1) * S, 2),
    # what a rank holds scales with PHI; activations move, not parameters: 2 passes per all-reduce and 1 gather
    "tensor": ({}, (4 * PHI * HELD / WHOLE, 4 * PHI * HELD / WHOLE, 8 * PHI * HELD / WHOLE, 0), TENSOR_SENT,
               2 * (4 * L + 2) + 1),
    # torch's loss_parallel: three all-reduces of one fp32 value per token where psarch all-gathers two
    "torch_tensor": ({}, (4 * PHI * HELD / WHOLE, 4 * PHI * HELD / WHOLE, 8 * PHI * HELD / WHOLE, 0),
                     TENSOR_SENT - (N - 1) * 2 * TOKENS * 4 + 3 * 2 * (N - 1) / N * TOKENS * 4, 2 * (4 * L + 2) + 6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_predict_matches_the_formulas(case):
    backend, memory, sent, rounds = CASES[case]
    kind = case.split("-")[0].rstrip("123")
    p = theory.predict(cfg(kind, **dict(backend)), PHI)
    m = p.memory_per_rank
    assert (m.params, m.grads, m.optimizer, m.buffers) == pytest.approx(memory), case
    assert (p.link.sent, p.link.received) == pytest.approx((sent, sent)), case
    assert p.rounds == pytest.approx(rounds), case
    if kind == "ps":
        every = backend.get("k_steps", 1) if backend["mode"] == "geo" else 1
        # every worker's push reaches the servers, each taking its 1/SERVERS share
        server = p.nodes["server"]
        assert (server.link.received, server.link.sent) == pytest.approx((N * S / SERVERS / every,) * 2)
        # a server keeps fp32 parameters, (except GEO, which adds deltas) AdamW's two fp32 moments, and in
        # sync an fp32 accumulator for the round's pushes
        per_param = {"sync": 4 + 8 + 4, "async": 4 + 8, "ssp": 4 + 8, "geo": 4}[backend["mode"]]
        assert server.memory.total == pytest.approx(per_param * PHI / SERVERS)
    else:
        assert not p.services   # no node serves the ranks


# backends whose theory reads the model itself (a pipeline's stages are its units), tested with it
COVERED_ELSEWHERE = {"pipeline": "tests/test_pipeline_theory.py", "torch_pipeline": "tests/test_pipeline_theory.py"}


def test_every_registered_backend_kind_is_covered():
    assert {c.split("-")[0].rstrip("123") for c in CASES} | set(COVERED_ELSEWHERE) == set(kinds())


def test_server_buffers_follow_the_mode():
    """GEO with a barrier sums a round's deltas; delay compensation keeps each worker's last-sent version."""
    geo = theory.predict(cfg("ps", mode="geo", k_steps=4, geo_barrier=True), PHI)
    assert geo.nodes["server"].memory.total == pytest.approx((4 + 4) * PHI / SERVERS)
    dc = theory.predict(cfg("ps", mode="async", staleness_compensation="dc"), PHI)
    assert dc.nodes["server"].memory.total == pytest.approx((4 + 8 + 4 * N) * PHI / SERVERS)


def test_precision_sets_the_wire_and_the_masters():
    """bf16: 2-byte parameters, gradients and wire; K = 12 with the fp32 master copy; servers stay fp32."""
    p = theory.predict(cfg("zero", stage=2, precision="bf16"), PHI)
    assert (p.memory_per_rank.params, p.memory_per_rank.grads, p.memory_per_rank.optimizer) == \
        pytest.approx((2 * PHI, 2 * PHI / N, 12 * PHI / N))
    assert p.link.sent == pytest.approx(2 * (N - 1) / N * 2 * PHI)
    ps = theory.predict(cfg("ps", mode="sync", precision="bf16"), PHI)
    assert ps.link.sent == 2 * PHI and ps.nodes["server"].memory.total == pytest.approx(16 * PHI / SERVERS)


def test_summary_prediction_is_predict_itself():
    """summary.json's `predicted` is predict's dict: GEO's k_steps is in it, not patched in afterwards."""
    d = theory.predict(cfg("ps", mode="geo", k_steps=4), PHI).to_dict()
    assert d["traffic_per_step"] == {"worker_sent": S / 4, "worker_received": S / 4,
                                     "server_sent": N * S / SERVERS / 4, "server_received": N * S / SERVERS / 4}
    assert d["server_memory"] == 4 * PHI / SERVERS and d["rounds_per_step"] == 0.5


def test_a_prediction_asks_no_role_by_name():
    """The core's questions of a Prediction read its nodes, whatever the backend names them: the fullest and busiest
    rank, each rank's node in rank order, the fullest device with what it hosts, and summary.json's keys (the busiest
    rank's link as worker_*, each serving role's under its own name)."""
    mem = theory.MemoryPrediction
    a = theory.NodePrediction(mem(4, 4, 8), theory.LinkBytes(30, 10), {"held": 1.0}, ranks=[0, 2])
    b = theory.NodePrediction(mem(8, 8, 16), theory.LinkBytes(20, 40), {"held": 2.0}, ranks=[1, 3])
    cache = theory.NodePrediction(mem(100, 0, 0), theory.LinkBytes(5, 6), host="odd")
    p = theory.Prediction({"even": a, "odd": b, "cache": cache}, rounds=2, messages=3)
    assert (p.fullest, p.busiest, p.memory_per_rank, p.link) == ("odd", "even", b.memory, a.link)
    assert list(p.services) == ["cache"] and p.rank_by_rank and p.per_rank == [a, b, a, b]
    assert p.device_memory() == 32 + 100   # the odd ranks' device holds the cache too
    d = p.to_dict()
    assert d["traffic_per_step"] == {"worker_sent": 30, "worker_received": 10, "cache_sent": 5, "cache_received": 6}
    assert d["memory_per_rank"]["total"] == 32 and d["cache_memory"] == 100   # type: ignore[typeddict-item]
    assert [r["held"] for r in d["per_rank"]] == [1.0, 2.0, 1.0, 2.0] and "server_memory" not in d
    alike = theory.Prediction.alike(mem(1, 1, 2), theory.LinkBytes(7, 7), 3, rounds=1, messages=2)
    assert alike.per_rank is None and "per_rank" not in alike.to_dict() and alike.device_memory() == 4


@pytest.mark.parametrize("placement", ["dedicated", "colocated"])
def test_a_colocated_server_is_on_its_workers_device(placement):
    """A colocated server's range (fp32, AdamW's K = 8, the round's fp32 accumulator) counts on its worker's device;
    a dedicated one's on a node of its own."""
    p = theory.predict(cfg("ps", server_placement=placement, n=SERVERS), PHI)
    assert p.nodes["server"].memory.total == pytest.approx((4 + 8 + 4) * PHI / SERVERS)
    server = p.nodes["server"].memory.total if placement == "colocated" else 0.0
    assert p.device_memory() == pytest.approx(p.memory_per_rank.total + server)


def test_unknown_kind_is_one_line():
    with pytest.raises(ValueError, match='backend.kind = "horovod": allowed values are "single", "ddp"'):
        theory.predict(cfg("horovod"), PHI)


# ---------------------------------------------------------------- the formulas themselves (ZeRO's paper, K, traffic)

def test_zero_paper_memory_example():
    """ZeRO paper (Rajbhandari et al. 2020), Table 1 / Fig. 1: Psi = 7.5B, N = 64, mixed-precision Adam
    (K = 12): DDP 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device."""
    phi, n = 7.5e9, 64
    assert theory.optimizer_bytes_per_param("adamw", "fp16") == 12
    ddp = theory.memory_per_rank("ddp", phi, n, "fp16", "adamw")
    assert ddp.total == pytest.approx(120e9)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (2 * phi, 2 * phi, 12 * phi)
    expected = {1: 31.4e9, 2: 16.6e9, 3: 1.875e9}  # the paper's figures, rounded to 0.1 GB
    for stage, total in expected.items():
        got = theory.memory_per_rank("zero", phi, n, "fp16", "adamw", stage=stage).total
        assert got == pytest.approx(total, abs=0.05e9), (stage, got)
    assert theory.memory_per_rank("zero", phi, n, "fp16", "adamw", stage=1).total == pytest.approx(31.40625e9)
    assert theory.memory_per_rank("zero", phi, n, "fp16", "adamw", stage=2).total == pytest.approx(16.640625e9)
    assert theory.memory_per_rank("zero", phi, n, "fp16", "adamw", stage=3).total == pytest.approx(1.875e9)
    assert theory.memory_per_rank("single", phi, 1, "fp16", "adamw").to_dict()["total"] == pytest.approx(120e9)


def test_optimizer_bytes_per_param():
    assert theory.optimizer_bytes_per_param("adamw", "fp32") == 8
    assert theory.optimizer_bytes_per_param("adamw", "bf16") == 12
    assert theory.optimizer_bytes_per_param("sgd", "fp32") == 0
    assert theory.optimizer_bytes_per_param("sgd", "fp32", momentum=0.9) == 4
    assert theory.optimizer_bytes_per_param("sgd", "fp16", momentum=0.9) == 8


def test_ps_memory():
    w = theory.memory_per_rank("ps", 1000, 4, "fp32", "adamw")
    assert (w.params, w.grads, w.optimizer) == (4000, 4000, 0)
    server = theory.predict(theory.config_for("ps", 1, "fp32", "adamw", servers=2), 1000).nodes["server"].memory.total
    assert server == (4 + 8 + 4) * 1000 / 2   # + the sync accumulator


def test_traffic_formulas():
    s = 1000.0
    assert theory.traffic_per_step("single", s, 1) == {"worker_sent": 0.0, "worker_received": 0.0}
    assert theory.traffic_per_step("ddp", s, 1)["worker_sent"] == 0.0
    assert theory.traffic_per_step("ddp", s, 4)["worker_sent"] == pytest.approx(2 * 3 / 4 * s)
    assert theory.traffic_per_step("torch_ddp", s, 2)["worker_received"] == pytest.approx(s)
    assert theory.traffic_per_step("zero", s, 4, stage=2)["worker_sent"] == pytest.approx(1.5 * s)
    assert theory.traffic_per_step("zero", s, 4, stage=3)["worker_sent"] == pytest.approx(2.25 * s)
    ps = theory.traffic_per_step("ps", s, 4, servers=2)
    assert ps == {"worker_sent": s, "worker_received": s, "server_received": 2 * s, "server_sent": 2 * s}
    assert theory.traffic_per_step("ps", s, 1)["worker_sent"] == s  # a single PS worker still talks to servers
    with pytest.raises(ValueError, match='backend.kind = "horovod": allowed values are'):
        theory.traffic_per_step("horovod", s, 2)
