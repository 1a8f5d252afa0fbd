"""A run's nodes by role, measured | predicted (psarch.report.nodes): summary.json's `nodes` beside predicted.nodes,
read the same way from a summary written before either (its per_rank lists, the PS's servers lists, ROLE_memory);
a run's measured nodes carry the roles theory names, and its bytes per role equal theory's where the per-rank
tests find them equal (a pipeline's stages, tests/test_pipeline.py), within the PS's bounds for its servers
(tests/test_theory_agreement.py)."""
from __future__ import annotations

import copy

import pytest

import psarch
from psarch.config import from_dict
from psarch.report import nodes

MEM = {"params": 400.0, "grads": 400.0, "optimizer": 0.0, "buffers": 0.0, "frozen": 0.0, "total": 800.0}
HELD = {"params": 300.0, "grads": 0.0, "optimizer": 600.0, "buffers": 0.0, "frozen": 0.0, "total": 900.0}


def old_style() -> dict:
    """A 2-worker, 2-server PS run as summary.json had it before `nodes`."""
    return {"name": "ps", "world_size": 2, "servers": 2, "steps": 10,
            "memory": {"per_rank": [dict(MEM, rank=r) for r in range(2)],
                       "servers": [dict(HELD, server=i, range=[0, 75], held=75) for i in range(2)]},
            "traffic": {"per_rank": [{"rank": r, "sent": 1000 + r, "received": 1000, "sent_per_step": 100.0 + r,
                                      "received_per_step": 100.0} for r in range(2)],
                        "servers": [{"server": i, "sent": 2000, "received": 2200 + i} for i in range(2)]},
            "predicted": {"memory_per_rank": MEM, "traffic_per_step": {
                "worker_sent": 100.0, "worker_received": 100.0, "server_sent": 100.0, "server_received": 100.0},
                "rounds_per_step": 2.0, "messages_per_step": 2.0, "server_memory": 900.0}}


def new_style() -> dict:
    """The same run as the launcher writes it now: with measured `nodes` and predicted.nodes, roles named as a
    backend might ("trainer", "store"): nothing in the adapter may depend on the names."""
    s = old_style()
    s["predicted"]["nodes"] = {
        "trainer": {"memory": MEM, "sent": 100.0, "received": 100.0, "ranks": [0, 1], "count": 2, "host": None},
        "store": {"memory": {"total": 900.0}, "sent": 100.0, "received": 100.0, "ranks": [], "count": 2,
                  "host": None}}
    s["nodes"] = nodes.measured_nodes({**s, "nodes": {"store": [   # type: ignore[typeddict-unknown-key]
        {"index": i, "memory": HELD, "sent": 2000, "received": 2200 + i} for i in range(2)]}})
    return s


@pytest.mark.parametrize("style", [old_style, new_style])
def test_the_adapter_reads_both_styles_alike(style):
    s = style()
    roles = nodes.roles(s)
    training, serving = [r for r in roles.values() if not r.serves], nodes.serving(s)
    assert len(training) == 1 and len(serving) == 1
    assert training[0].ranks == [0, 1] and [n["rank"] for n in training[0].measured] == [0, 1]
    assert training[0].mean("sent") == (100.5, 100.0) and training[0].mean("memory") == (800.0, 800.0)
    srv = serving[0]
    assert [n["index"] for n in srv.measured] == [0, 1] and len(srv.predicted) == 2
    assert srv.mean("received") == (pytest.approx(220.05), 100.0)   # run totals over the 10 steps
    assert srv.mean("memory") == (900.0, 900.0) and srv.measured[0]["memory"]["optimizer"] == 600.0
    assert nodes.system(s) == (2 * 800 + 2 * 900, 2 * 800 + 2 * 900)
    assert nodes.ranks_mean(s, "sent") == (100.5, 100.0)
    assert nodes.predicted_of_rank(s, 1)["memory"]["total"] == 800.0


def test_the_old_style_names_its_roles_by_its_keys_and_theory_by_its_own():
    old = old_style()
    assert list(nodes.roles(old)) == ["worker", "server"]   # worker_sent, server_memory
    # a run loaded now: theory's nodes (this checkout's) beside an old summary's measured lists
    mixed = copy.deepcopy(old)
    mixed["predicted"]["nodes"] = new_style()["predicted"]["nodes"]
    roles = nodes.roles(mixed)
    assert list(roles) == ["trainer", "store"]
    assert [n["index"] for n in roles["store"].measured] == [0, 1] and len(roles["trainer"].measured) == 2


def test_a_summary_without_servers_has_no_serving_role():
    s = old_style()
    del s["memory"]["servers"], s["traffic"]["servers"], s["predicted"]["server_memory"]
    s["servers"] = 0
    assert nodes.serving(s) == [] and nodes.system(s) == (1600.0, 1600.0)


TINY = {"seed": 0, "workload": {"model": "gpt", "seq_len": 8, "gpt": {"n_layer": 2, "n_embd": 16, "n_head": 2},
                                "markov": {"vocab_size": 16}},
        "train": {"steps": 4, "global_batch": 8, "log_every": 100}}


def test_a_pipeline_run_writes_each_stage_as_theory_names_it_with_its_bytes(tmp_path):
    """Each stage's measured bytes per step equal its prediction exactly (as tests/test_pipeline.py finds per
    rank), in summary.json's `nodes` under the roles of predicted.nodes."""
    cfg = from_dict(dict(TINY, name="pp", backend={"kind": "pipeline", "world_size": 2, "schedule": "gpipe",
                                                   "microbatches": 4}))
    s = psarch.run(cfg, out=tmp_path / "pp", echo=False)
    assert list(s["nodes"]) == list(s["predicted"]["nodes"]) and len(s["nodes"]) == 2
    for name, measured in s["nodes"].items():
        predicted = s["predicted"]["nodes"][name]
        assert [n["rank"] for n in measured] == predicted["ranks"]
        for n in measured:
            assert (n["sent_per_step"], n["received_per_step"]) == (predicted["sent"], predicted["received"]), name
            assert (n["memory"]["params"], n["memory"]["grads"]) == \
                (predicted["memory"]["params"], predicted["memory"]["grads"]), name
            assert n["sent_per_step"] > 0
    # the same answers from the old keys alone
    old = {k: v for k, v in s.items() if k != "nodes"}
    old["predicted"] = {k: v for k, v in s["predicted"].items() if k != "nodes"}
    assert nodes.ranks_mean(old, "sent") == nodes.ranks_mean(s, "sent")
    assert nodes.system(old) == nodes.system(s)


def test_a_ps_run_writes_each_server_as_a_node_of_its_serving_role(tmp_path):
    """The servers' nodes: their memory and run totals as the servers measured them, per step over the steps,
    within theory's bounds (headers: tests/test_theory_agreement.py); the workers' under their own role."""
    cfg = from_dict(dict(TINY, name="ps", backend={"kind": "ps", "mode": "sync", "world_size": 2, "servers": 2}))
    s = psarch.run(cfg, out=tmp_path / "ps", echo=False)
    assert list(s["nodes"]) == list(s["predicted"]["nodes"])
    serving = nodes.serving(s)
    assert len(serving) == 1 and len(serving[0].measured) == 2 == len(serving[0].predicted)
    role = serving[0]
    predicted = s["predicted"]["nodes"][role.name]
    for n, t, m in zip(role.measured, s["traffic"]["servers"], s["memory"]["servers"]):
        assert (n["index"], n["sent"], n["received"], n["memory"]["total"]) == \
            (t["server"], t["sent"], t["received"], m["total"])
        assert predicted["received"] * 0.9 <= n["received_per_step"] <= 1.01 * predicted["received"] * 1.1 + 64
        assert predicted["memory"]["total"] <= n["memory"]["total"] <= predicted["memory"]["total"] + 4
    (training,) = [r for r in nodes.roles(s).values() if not r.serves]
    assert [n["rank"] for n in training.measured] == [0, 1]
    sent, want = training.mean("sent")
    assert want is not None and want <= sent <= 1.01 * want + 64
