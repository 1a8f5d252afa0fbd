"""Where a traced PowerSGD step's communication goes, measured against the step simulator (README.md here, "Three
defects of the emulation"): for each run folder (gpt_powersgd_n8_probe.toml's, with trace.json), per all-reduce of a
traced compressed step (the whole tensors, every P, every Q): its time on the ranks (the "ring" lane, mean over
ranks), its ring steps' (the "ring steps" lane: from a step's post to its chunk received
and added), and what the simulator gives the same all-reduce (its transfers' sum, trace_predicted's "to rank" lanes).
Times are the cluster's (wall / D); `extra/step` is (measured - predicted) / ring steps, beside one 1514-byte frame at
the link rate. A ring ddp run's (torch_ddp's trace holds no ring lanes).

    python experiments/compression/ring_steps.py runs/compression/psgd8/*
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean, median

from psarch.report.runs import load_run, run_config
from psarch.report.timeline import one_step, predicted_spans
from psarch.report.trace import read_trace

FRAME = 1514   # bytes of a full Ethernet frame on the wire


def measured(run: Path, step: int) -> dict[str, list[float]]:
    """Per all-reduce of `step` (in issue order: its name, e.g. "all_reduce 20.50 KiB"): each rank's call time and
    its mean ring step, seconds; plus the step's "step" span per rank."""
    spans = one_step(read_trace(run / "trace.json"), step)
    out: dict[str, list[float]] = defaultdict(list)
    for rank in sorted({s.node for s in spans}):
        box = [s for s in spans if s.node == rank and s.lane == "step" and s.name == f"step {step}"][0]
        mine = [s for s in spans if s.node == rank and box.start <= s.start and s.end <= box.end]
        calls = sorted((s for s in mine if s.lane == "ring"), key=lambda s: s.start)
        ring_steps = [s for s in mine if s.lane == "ring steps"]
        for i, c in enumerate(calls):
            inside = [s.end - s.start for s in ring_steps if c.start <= s.start and s.end <= c.end]
            out[f"{i}:{c.name}"].append(c.end - c.start)
            out[f"{i}:{c.name}:steps"].append(mean(inside) if inside else float("nan"))
            out[f"{i}:{c.name}:n"].append(len(inside))
        out["step"] += [s.end - s.start for s in mine if s.lane == "step"]
        out["waits"] += [s.end - s.start for s in mine if s.lane == "waits"]
    return out


def predicted(run: Path) -> list[float]:
    """The simulator's time of each collective of the step on rank 0, in issue order: its transfers' span."""
    spans, _ = predicted_spans(run)
    by: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        if s.node == "rank 0" and s.lane.startswith("to rank") and s.name.startswith("c"):
            by[s.name.split(".")[0] + "." + s.name.split(".")[1]].append((s.start, s.end))
    return [max(e for _, e in v) - min(a for a, _ in v) for _, v in sorted(by.items(), key=lambda kv: kv[1][0][0])]


def report(run: Path) -> None:
    cfg, summary = run_config(load_run(run)), load_run(run)["summary"]
    n, mbps, d = cfg.backend.world_size, cfg.cluster.link_mbps, summary["dilation"]
    frame_ms = FRAME * 8 / (mbps * 1e6) * 1e3
    print(f"\n{run.name}: N = {n}, {mbps:g} Mbit/s, D = {d:g}; step {summary['step_time_s'] * 1e3:.2f} ms measured, "
          f"comm wait {summary['comm_s'] * 1e3:.2f} ms; one frame {frame_ms:.3f} ms")
    pred = predicted(run)
    for step in cfg.train.trace_steps:
        got = measured(run, step)
        calls = [k for k in got if k.count(":") == 1]
        print(f"  step {step}: step {median(got['step']) * 1e3:.2f} ms, "
              f"all-reduce wait {median(got['waits']) * 1e3:.2f} ms (medians over ranks)")
        for i, k in enumerate(calls):
            m, p, steps = mean(got[k]), pred[i] if i < len(pred) else float("nan"), 2 * (n - 1)
            print(f"    {k.split(':')[1]:22s} measured {m * 1e3:6.3f} ms | predicted {p * 1e3:6.3f} ms; ring step "
                  f"{mean(got[k + ':steps']) * 1e3:6.3f} ms ({min(got[k + ':n'])}-{max(got[k + ':n'])} traced); "
                  f"extra/step {(m - p) / steps * 1e3:6.3f} ms = {(m - p) / steps * 1e3 / frame_ms:4.2f} frames")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        report(Path(arg))
