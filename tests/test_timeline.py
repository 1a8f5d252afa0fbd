"""Timelines: the Chrome trace writer, the simulator's predicted step as spans, and a run's measured steps
(train.trace_steps) in <run>/trace.json."""
from __future__ import annotations

import json

import pytest

import psarch
from collective.program import ddp_program
from psarch.config import ConfigError, from_dict
from psarch.report.timeline import main as timeline_main, one_step
from psarch.report.trace import read_trace, trace_events, write_trace
from psarch.theory.program import Cluster, DataStep
from psarch.theory.simulate import simulate, spans
from psarch.timeline import Recorder, Span
from psarch.ps.program import ps_program, slots_of

TINY = {"seq_len": 8, "gpt": {"n_layer": 1, "n_embd": 16, "n_head": 2}}


def test_trace_events_are_complete_events_in_microseconds_with_named_nodes_and_lanes(tmp_path):
    got = [Span("rank 0", "compute", "forward", 10.0, 10.5), Span("rank 1", "ring", "all_reduce", 10.25, 11.0),
           Span("rank 0", "ring", "all_reduce", 10.5, 11.0)]
    events = trace_events(got)["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in xs] == [
        ("forward", 0.0, 500000.0), ("all_reduce", 250000.0, 750000.0), ("all_reduce", 500000.0, 500000.0)]
    nodes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert nodes == {0: "rank 0", 1: "rank 1"}
    assert [lanes[e["pid"], e["tid"]] for e in xs] == ["compute", "ring", "ring"]
    assert xs[0]["tid"] != xs[2]["tid"] and xs[1]["tid"] != xs[2]["tid"]   # a lane is a thread of its own node
    path = write_trace(tmp_path / "t.json", got)
    assert json.loads(path.read_text())["traceEvents"] == events
    back = read_trace(path)
    assert [(s.node, s.lane, s.name) for s in back] == [(s.node, s.lane, s.name) for s in got]
    assert [(s.start, s.end) for s in back] == pytest.approx([(s.start - 10.0, s.end - 10.0) for s in got])


def test_a_span_that_ends_before_it_starts_is_refused():
    with pytest.raises(ValueError, match="'x' on rank 0/compute ends"):
        trace_events([Span("rank 0", "compute", "x", 2.0, 1.0)])
    with pytest.raises(ValueError, match="not a Chrome trace"):
        read_trace(__file__)


def test_the_recorder_keeps_nothing_while_off_and_every_span_while_on():
    r = Recorder()
    r.add("compute", "forward", 1.0, 2.0)
    with r.span("ring", "all_reduce"):
        pass
    assert r.take("rank 0") == []
    r.on = True
    r.add("compute", "forward", 1.0, 2.0)
    with r.span("ring", "all_reduce"):
        pass
    got = r.take("rank 3")
    assert [(s.node, s.lane, s.name) for s in got] == [("rank 3", "compute", "forward"),
                                                       ("rank 3", "ring", "all_reduce")]
    assert got[0].end - got[0].start == pytest.approx(1.0) and got[1].end >= got[1].start
    assert r.take("rank 3") == []


@pytest.mark.parametrize("n", [2, 4])
def test_the_simulated_step_as_spans_ends_when_the_simulator_says_and_keeps_every_order(n):
    step = DataStep(0.01, 0.02, 0.001)
    program = ddp_program(n, [4e5, 4e5, 2e5], step, overlap=True)
    cluster = Cluster.of(program, 1.25e7, 1e-4)
    got = spans(program, cluster)
    assert max(s.end for s in got) == pytest.approx(simulate(program, cluster).step_s)
    assert {s.node for s in got} == {f"rank {r}" for r in range(n)}
    by = {s.name: s for s in got}
    for r in range(n):
        assert by[f"fwd{r}"].lane == "compute" and by[f"fwd{r}"].end - by[f"fwd{r}"].start == pytest.approx(0.01)
        assert by[f"opt{r}"].start >= by[f"bwd{r}.2"].end - 1e-12
        # each ring step moves 1/n of the bucket to the next rank, after the previous step's chunk came in
        first = by[f"ar0.0.{r}"]
        assert first.lane == f"to rank {(r + 1) % n}" and first.start >= by[f"bwd{r}.0"].end - 1e-12
        assert by[f"ar0.1.{r}"].start >= by[f"ar0.0.{(r - 1) % n}"].end - 1e-12
        # α, then 1/n of the bucket at the link's rate
        assert first.end - first.start == pytest.approx(1e-4 + 4e5 / n / 1.25e7)
    assert len([s for s in got if s.name.startswith("ar")]) == 3 * 2 * (n - 1) * n


def test_a_ps_program_names_its_servers_and_their_connections():
    program = ps_program(2, slots_of([[(0, 100)], [(100, 200)]], 4, hooks=True), False, DataStep(0.01, 0.02))
    got = spans(program, Cluster.of(program, 1e6))
    assert {s.node for s in got} == {"rank 0", "rank 1", "server 0", "server 1"}
    assert {s.lane for s in got if s.node == "server 1"} == {"to rank 0", "to rank 1"}
    assert {s.lane for s in got if s.node == "rank 0"} == {"compute", "to server 0", "to server 1"}


def test_trace_steps_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train.trace_steps = \[4\]: expected step numbers in \[-4, 4\)"):
        from_dict({"train": {"steps": 4, "trace_steps": [4]}})
    with pytest.raises(ConfigError, match="train.trace_steps"):
        from_dict({"train": {"steps": 4, "trace_steps": ["last"]}})


def test_a_ring_ddp_run_writes_each_ranks_traced_step(tmp_path):
    cfg = from_dict({"name": "traced", "seed": 1, "workload": TINY,
                     "train": {"steps": 3, "global_batch": 4, "trace_steps": [-1]},
                     "backend": {"kind": "ddp", "world_size": 2, "comm": "ring", "bucket_cap_mb": 0.01}})
    psarch.run(cfg, out=tmp_path / "run", echo=False)
    got = read_trace(tmp_path / "run" / "trace.json")
    for r in range(2):
        mine = [s for s in got if s.node == f"rank {r}"]
        steps = [s for s in mine if s.lane == "step"]
        assert [s.name for s in steps] == ["step 2"]   # the last step alone
        names = [s.name for s in mine if s.lane == "compute"]
        assert names == ["forward", "backward", "optimizer"]
        reduces = [s for s in mine if s.lane == "ring"]
        assert len(reduces) >= 2 and all(s.name.startswith("all_reduce ") for s in reduces)
        # every span inside its step, the all-reduces one after another on the communicator's thread
        assert all(steps[0].start - 1e-6 <= s.start <= s.end <= steps[0].end + 1e-6 for s in mine)
        assert all(a.end <= b.start + 1e-6 for a, b in zip(reduces, reduces[1:]))
    # one clock: the ranks' steps overlap in time (a collective holds them together)
    a, b = [s for s in got if s.lane == "step"]
    assert a.start < b.end and b.start < a.end
    # the simulator's step of the same run beside it, and the picture of both
    assert timeline_main([str(tmp_path / "run")]) == 0
    predicted = read_trace(tmp_path / "run" / "trace_predicted.json")
    assert {(s.node, s.lane) for s in predicted} == {("rank 0", "compute"), ("rank 0", "to rank 1"),
                                                     ("rank 1", "compute"), ("rank 1", "to rank 0")}
    assert (tmp_path / "run" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="step 0 was not traced; the trace holds step 2"):
        timeline_main([str(tmp_path / "run"), "--step", "0"])


def test_one_step_cuts_the_window_of_a_traced_step_and_names_a_step_not_traced():
    got = [Span("rank 0", "step", "step 3", 5.0, 6.0), Span("rank 0", "compute", "forward", 5.1, 5.3),
           Span("rank 1", "step", "step 3", 5.2, 6.1), Span("rank 0", "step", "step 7", 9.0, 10.0),
           Span("rank 0", "compute", "forward", 9.1, 9.2)]
    three = one_step(got, 3)
    assert [(s.node, s.name, round(s.start, 9)) for s in three] == [
        ("rank 0", "step 3", 0.0), ("rank 0", "forward", 0.1), ("rank 1", "step 3", 0.2)]
    assert [s.name for s in one_step(got)] == ["step 7", "forward"]   # the last traced by default
    with pytest.raises(ValueError, match="step 4 was not traced; the trace holds step 3, step 7"):
        one_step(got, 4)


@pytest.mark.parametrize("backend, lanes", [
    ({"kind": "zero", "stage": 2, "comm": "ring"}, {"step", "compute", "ring", "ring steps", "waits"}),
    ({"kind": "ddp", "comm": "native", "bucket_cap_mb": 0.01}, {"step", "compute", "native", "waits"}),
    ({"kind": "ps", "servers": 2, "partition_mb": 0.01}, {"step", "compute", "to server 0", "to server 1", "waits"}),
], ids=["zero2", "ddp-native", "ps"])
def test_zero_native_and_ps_runs_trace_their_communication_calls(tmp_path, backend, lanes):
    cfg = from_dict({"name": "traced", "seed": 1, "workload": TINY,
                     "train": {"steps": 3, "global_batch": 4, "trace_steps": [1]},
                     "backend": {"world_size": 2, **backend}})
    psarch.run(cfg, out=tmp_path / "run", echo=False)
    got = read_trace(tmp_path / "run" / "trace.json")
    for r in range(2):
        mine = [s for s in got if s.node == f"rank {r}"]
        assert {s.lane for s in mine} == lanes
        step = next(s for s in mine if s.lane == "step")
        assert step.name == "step 1" and all(step.start - 1e-6 <= s.start <= s.end <= step.end + 1e-6 for s in mine)
        # the ring's own steps (world size 2, one segment: one a reduce-scatter or all-gather), each in its call
        ring_calls, ring_steps = [s for s in mine if s.lane == "ring"], [s for s in mine if s.lane == "ring steps"]
        pipelined = [c for c in ring_calls if c.name.split()[0] in ("reduce_scatter", "all_gather")]
        assert len(ring_steps) == len(pipelined) and (ring_steps or "ring" not in lanes)
        assert all(any(c.start - 1e-6 <= s.start <= s.end <= c.end + 1e-6 for c in pipelined) for s in ring_steps)
    names = {s.name.split()[0] for s in got if s.lane not in ("step", "compute", "waits", "rounds", "ring steps")}
    calls = {"zero": {"reduce_scatter", "all_gather"}, "ddp": {"all_reduce"}, "ps": {"pushpull"}}
    assert names == calls[backend["kind"]]
    if backend["kind"] == "ps":   # each server's rounds of the traced step, one per partition it holds
        rounds = [s for s in got if s.lane == "rounds"]
        assert {s.node for s in rounds} == {"server 0", "server 1"}
        assert all(s.name.startswith("round 1 [") for s in rounds)
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert sum(d["partitions"] for d in summary["servers_detail"]) == len(rounds) and "timeline" not in summary
        # a round ends before the last pull of it is answered to a worker that traced the step
        pulls = [s for s in got if s.name.startswith("pushpull")]
        assert max(s.end for s in rounds) <= max(s.end for s in pulls) + 1e-6


def test_a_config_alone_gives_its_predicted_step(tmp_path):
    (tmp_path / "c.toml").write_text('name = "c"\n[workload]\nseq_len = 8\n[workload.gpt]\nn_layer = 1\nn_embd = 16\n'
                                     'n_head = 2\n[train]\nglobal_batch = 4\n[backend]\nkind = "ddp"\nworld_size = 4\n')
    assert timeline_main([str(tmp_path / "c.toml"), "--compute-s", "0.01", "--out", str(tmp_path / "out")]) == 0
    got = read_trace(tmp_path / "out" / "c_predicted.json")
    assert {s.node for s in got} == {f"rank {r}" for r in range(4)}
    computed = sum(s.end - s.start for s in got if s.node == "rank 0" and s.lane == "compute")
    assert computed == pytest.approx(0.01, rel=1e-3)
    assert (tmp_path / "out" / "c_predicted.png").exists()
    with pytest.raises(SystemExit, match="is a config: give --compute-s"):
        timeline_main([str(tmp_path / "c.toml")])
