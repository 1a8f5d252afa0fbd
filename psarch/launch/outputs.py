"""A run folder: config.json, metrics.jsonl, summary.json, model.pt, report.txt (and trace.json: the timelines of
train.trace_steps)."""
from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path
from typing import Any, cast

import torch

from psarch import registry, theory, throughput
from psarch.cluster import device, startup
from psarch.config import Config
from psarch.records import MetricsRow, Predicted, RankRecord, StepRecord, Summary
from psarch.launch.failure_cost import failure_cost, report_lines as failure_cost_lines
from psarch.throughput import warmup_steps
from psarch.report.nodes import measured_nodes, serving
from psarch.report.trace import write_trace
from psarch.timeline import Span
from psarch.units import fmt_bytes

RANKS_DIR = "ranks"


def run_folder(cfg: Config, out: str | Path | None = None) -> Path:
    """Where a run writes: `out` if given, else the config's `out`, else runs/<name>."""
    return Path(out or cfg.out or Path("runs") / cfg.name)


def holds_finished_run(folder: Path) -> bool:
    """Whether this folder holds a run that finished (a failed or interrupted one may be replaced)."""
    try:
        return json.loads((folder / "summary.json").read_text()).get("status", "finished") == "finished"
    except (OSError, ValueError):
        return False


def prepare(out: Path, cfg: Config, keep_checkpoints: bool = False) -> None:
    """Create the run folder, write the resolved config, clear per-rank leftovers of an earlier run (and its
    checkpoints, unless this run resumes from them: a later --resume must never pick an older run's)."""
    (out / RANKS_DIR).mkdir(parents=True, exist_ok=True)
    if not keep_checkpoints:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    for f in (out / RANKS_DIR).iterdir():
        f.unlink()
    for name in ("summary.json", "metrics.jsonl", "model.pt", "report.txt"):
        (out / name).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


def stream_path(out: Path, rank: int) -> Path:
    """Where a rank appends its step records as its steps complete (kept when the run fails)."""
    return out / RANKS_DIR / f"rank{rank}.jsonl"


def save_record(out: Path, record: RankRecord) -> None:
    """Write one rank's record; rank 0 also writes the consolidated model. Step records the rank streamed
    to stream_path are read back from there, not stored twice."""
    if record.model_state is not None:
        torch.save(record.model_state, out / "model.pt")
    data = record.to_json()
    if _streamed_steps(out, record.rank) == record.steps:
        data["steps"] = None   # in stream_path
    (out / RANKS_DIR / f"rank{record.rank}.json").write_text(json.dumps(data))


def _streamed_steps(out: Path, rank: int) -> list[StepRecord]:
    try:
        text = stream_path(out, rank).read_text()
    except OSError:
        return []
    # a rank killed mid-write leaves a partial last line: every complete line is a finished step
    return [json.loads(line) for line in text.split("\n")[:-1]]


def _records(out: Path) -> list[RankRecord]:
    records = sorted((RankRecord.from_json(json.loads(p.read_text())) for p in (out / RANKS_DIR).glob("rank*.json")),
                     key=lambda r: r.rank)
    for r in records:
        if r.steps is None:
            r.steps = _streamed_steps(out, r.rank)
    return records


def _write_metrics(out: Path, per_rank: list[list[StepRecord]]) -> list[MetricsRow]:
    """metrics.jsonl: one line per step, merged over the ranks that finished it; returns the lines."""
    rows: list[MetricsRow] = []
    by_step = [{x["step"]: x for x in r} for r in per_rank]  # a run started from a checkpoint starts late
    for s in sorted({step for r in by_step for step in r}):
        per = [r[s] for r in by_step if s in r]
        # workers_sent/received: bytes all workers together sent/received in this step
        row: MetricsRow = {"step": s, "loss": statistics.fmean(p["loss"] for p in per),
                           "step_time_s": max(p["step_time_s"] for p in per),
                           "workers_sent": sum(p["sent"] for p in per),
                           "workers_received": sum(p["received"] for p in per),
                           "skipped": any(p.get("skipped") for p in per)}
        scale = per[0].get("loss_scale")
        if scale is not None:
            row["loss_scale"] = scale
        if len(per) > 1:
            row["workers"] = per
        elif per[0].get("extra"):
            row["extra"] = per[0]["extra"]
        rows.append(row)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _dropped_streams(out: Path, records: list[RankRecord]) -> list[list[StepRecord]]:
    """The streamed steps of ranks that left no record (faults.restart = "shrink" dropped them)."""
    have = {r.rank for r in records}
    ranks = sorted(int(p.stem[4:]) for p in (out / RANKS_DIR).glob("rank*.jsonl"))
    return [_streamed_steps(out, r) for r in ranks if r not in have]


def has_records(out: Path) -> bool:
    """Whether some rank left its record (finalize needs one)."""
    return any((out / RANKS_DIR).glob("rank*.json"))


def finalize_stopped(out: Path, cfg: Config, status: str, error: str, extra: Summary | None = None
                     ) -> Summary:
    """A run that failed or was interrupted: metrics.jsonl with every step some rank finished, and a
    summary.json that says so, with the error's first line (and `extra`, what the services measured)."""
    streams = sorted((out / RANKS_DIR).glob("rank*.jsonl"), key=lambda p: int(p.stem[4:]))
    rows = _write_metrics(out, [_streamed_steps(out, int(p.stem[4:])) for p in streams])
    # the backend's identity fields and the services' `extra` add keys of their own
    summary = cast(Summary, {"name": cfg.name, "status": status,
                             "error": error.strip().splitlines()[0] if error.strip() else "",
                             **identity(cfg), "steps": len(rows), "steps_planned": cfg.train.steps,
                             "final_loss": rows[-1]["loss"] if rows else None, **(extra or {})})
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def finalize_lost(out: Path, cfg: Config, extra: Summary) -> str:
    """A mode that goes on without lost workers lost them all: a summary that says so (status failed, the lost
    workers, what the services measured) and metrics.jsonl with every step streamed; returns the error."""
    lost = extra.get("lost_workers") or []
    error = "every worker was lost: " + "; ".join(w["error"] for w in lost) if lost else "no rank left a record"
    finalize_stopped(out, cfg, "failed", error, extra)
    return error


def identity(cfg: Config) -> Summary:
    """What a summary says of the run's backend, from its spec (psarch/backend.py): its kind, variant and the
    one label every report, plot and cluster table uses; whether its workers step in lockstep; and the
    backend's own fields (the PS's servers; 0 elsewhere)."""
    spec = registry.spec_of(cfg)
    return {"backend": cfg.backend.kind, "variant": spec.variant(cfg), "label": spec.label(cfg),
            "lockstep": spec.lockstep(cfg), "world_size": cfg.backend.world_size, "servers": 0,
            **spec.summary_fields(cfg)}


def finalize(out: Path, cfg: Config, extra: Summary | None = None, echo: bool = True) -> Summary:
    """Merge the ranks' records into metrics.jsonl, summary.json and report.txt (and, with train.trace_steps, the
    ranks' and the services' spans into trace.json)."""
    extra = cast(Summary, dict(extra or {}))   # a copy: the services' spans are taken out of it
    server_spans = extra.pop("timeline", [])
    records = _records(out)
    if not records:
        raise RuntimeError(f"{out}: no rank left a record")
    # a shrunk world's dropped ranks have no record: their steps before its checkpoint, kept by the launcher
    dropped = _dropped_streams(out, records) if extra.get("restarts") else []
    rows = _write_metrics(out, [[x for x in r.steps if x["step"] < cfg.train.steps] for r in records] + dropped)
    by_step = [{x["step"]: x for x in r.steps} for r in records]
    w = warmup_steps(cfg)
    timed = [r["step_time_s"] for r in rows[w:]] or [r["step_time_s"] for r in rows]
    step_time = statistics.median(timed)
    phi = records[0].params
    floor = records[0].entropy_floor
    final_loss = rows[-1]["loss"]
    ident = identity(cfg)
    # the services' `extra` and the backend's identity fields add keys of their own: built as a plain dict
    merged: dict[str, Any] = {
        "name": cfg.name, "status": "finished", **ident, "workload": records[0].workload, "precision": cfg.train.precision, "optimizer": cfg.train.optimizer,
        "params": phi, "frozen_params": records[0].frozen_params, "steps": len(rows), "global_batch": cfg.train.global_batch,
        "final_loss": final_loss, "entropy_floor": floor,
        "gap": final_loss - floor if floor is not None else None,
        "step_time_s": step_time,
        "samples_per_s": throughput.samples_per_s(rows, cfg.train.global_batch, ident["lockstep"], w),
        "samples_per_s_is": throughput.definition(ident["lockstep"]),
        "comm_s": statistics.median([statistics.fmean(b[r["step"]]["comm_s"] for b in by_step if r["step"] in b)
                                     for r in rows[w:]] or [0.0]),
        "skipped_steps": sum(1 for r in rows if r["skipped"]),
        "device": records[0].device, "dist_backend": records[0].dist_backend,
        "memory": {"per_rank": [dict(r.memory, rank=r.rank) for r in records]},
        # per-step figures from the steps alone (set-up broadcasts and the final gather left out)
        "traffic": {"per_rank": [dict(r.traffic, rank=r.rank,
                                      sent_per_step=statistics.fmean(x["sent"] for x in r.steps),
                                      received_per_step=statistics.fmean(x["received"] for x in r.steps))
                                 for r in records]},
        "predicted": theory.predict(cfg, phi, records[0].frozen_params).to_dict(),
        "lost_workers": [],
    }
    _merge_extra(merged, records, extra)
    merged["nodes"] = measured_nodes(cast(Summary, merged))   # each role's nodes, as the prediction names them
    vd = device.summary(cfg, records, {r["step"] for r in rows[w:]})
    if vd is not None:   # a virtual device: its FLOPs, D, overrun steps (before theory, which reads them)
        merged["virtual_device"] = vd
    if merged.get("cluster", {}).get("emulated"):
        merged["cluster"]["step_time"] = theory.cluster_step(cfg, cast(Summary, merged))
    summary = cast(Summary, merged)
    if cfg.faults.startup_s:   # each world's start-up paced as the cluster's, its overruns
        summary["startup"] = startup.summary(cfg, summary.get("worlds") or [])
    if summary.get("restarts") and "ended_at_s" in summary:   # faults.restart = "replace" restarted the world
        summary["failure_cost"] = failure_cost(summary, cfg.train.checkpoint_every,
                                                {r["step"]: r["step_time_s"] for r in rows},
                                                lambda n: theory.world_step(cfg, summary, n), cfg.faults.startup_s)
    spans = [Span.of(x) for r in records for x in r.timeline] + [Span.of(x) for x in server_spans]
    if spans:   # train.trace_steps: the ranks' timelines in one file Perfetto opens
        write_trace(out / "trace.json", spans)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = report(summary)
    (out / "report.txt").write_text(text)
    if echo:
        print(text, end="", flush=True)
    return summary


def _merge_extra(merged: dict[str, Any], records: list[RankRecord], extra: Summary) -> None:
    """Into the summary: each rank's `extra` fields as lists by rank, then the launcher's and services' `extra`
    (a dict merged into the summary's dict of the same key, anything else set)."""
    for r in records:
        for k, v in (r.extra or {}).items():
            merged.setdefault("extra", {}).setdefault(k, []).append(v)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k].update(v)
        else:
            merged[k] = v


def predicted_for_rank(predicted: Predicted, rank: int) -> tuple[dict[str, float], float]:
    """(memory by category, bytes sent per step) theory predicts for rank `rank`: its own where ranks differ
    (Prediction.per_rank), else every rank's."""
    per = predicted.get("per_rank")
    if per and rank < len(per):
        return per[rank]["memory"], per[rank]["sent"]
    return predicted["memory_per_rank"], predicted["traffic_per_step"]["worker_sent"]


def report(s: Summary) -> str:
    """The short human-readable report of one run."""
    lines = _headline(s) + [""] + _rank_table(s) + _server_lines(s) + _fault_lines(s)
    if s.get("auth") == "none":
        lines.append("auth: none (backend.auth = \"none\": any process on this machine could talk to the servers)")
    pushes = s.get("refused_pushes")
    refused = (pushes.get("non_finite_per_worker") if pushes else None) or []
    if any(refused):
        lines.append(f"pushes refused for inf/nan, per worker: {refused}")
    lines += _cluster_lines(s)
    if s.get("virtual_device"):
        lines += device.report_lines(s["virtual_device"], s.get("cluster", {}).get("alpha_s"))
    lines += [dropped_line(d) for d in s.get("dropped_workers") or []]
    return "\n".join(lines) + "\n"


def _headline(s: Summary) -> list[str]:
    """The run (name, architecture, N, workload, params, precision, optimizer), its final loss and its step time."""
    kind = s.get("label") or s["backend"] + (f" ({s['variant']})" if s["variant"] else "")
    gap = f"  (gap to entropy floor {s['gap']:.4f})" if s.get("gap") is not None else ""
    return [
        f"== {s['name']}: {kind}, N={s['world_size']}" + (f", servers={s['servers']}" if s["servers"] and not s.get("label") else "")
        + f", {s['workload']}, {s['params']:,} params"
        + (f" (+{s['frozen_params']:,} frozen)" if s.get("frozen_params") else "") + f", {s['precision']}, {s['optimizer']}",
        f"final loss      {s['final_loss']:.4f} (last step){gap}   skipped steps {s['skipped_steps']}",
        f"step time       {s['step_time_s'] * 1e3:.2f} ms median   {s['samples_per_s']:.1f} samples/s"
        + (f" ({s['samples_per_s_is']})" if s.get("samples_per_s_is") else "")
        + (f"   comm wait {s['comm_s'] * 1e3:.2f} ms" if s.get("comm_s") else ""),
    ]


def _rank_table(s: Summary) -> list[str]:
    """Each rank's memory by category and bytes sent per step, beside theory's."""
    # padding (inside total) and transient peaks (outside it: gathered units, gradient buffers, both
    # together as working) get a column only where some rank has them, so other backends' reports stay narrow
    per_rank = s["memory"]["per_rank"]
    optional = [(k, head) for k, head in (("frozen", "frozen"), ("padding", "padding"), ("error_feedback", "error fb"),
                                          ("gathered_peak", "gathered"),
                                          ("grad_buffer_peak", "grad bufs"), ("working", "working"))
                if any(m.get(k) for m in per_rank)]
    lines = [f"{'rank':>4}  {'params':>11} {'grads':>11} {'optimizer':>11} {'total':>11} {'predicted':>11}"
             + "".join(f" {head:>11}" for _, head in optional)
             + f" {'peak':>11}  {'sent/step':>11} {'predicted':>11}"]
    for i, (m, t) in enumerate(zip(per_rank, s["traffic"]["per_rank"])):
        pm, sent = predicted_for_rank(s["predicted"], i)
        modelled = " (modelled)" if t.get("modelled") else ""
        lines.append(f"{m['rank']:>4}  {fmt_bytes(m['params']):>11} {fmt_bytes(m['grads']):>11} {fmt_bytes(m['optimizer']):>11} "
                     f"{fmt_bytes(m['total']):>11} {fmt_bytes(pm['total']):>11}"
                     + "".join(f" {fmt_bytes(m.get(k, 0)):>11}" for k, _ in optional)
                     + f" {fmt_bytes(m.get('peak')):>11}  "
                     f"{fmt_bytes(t['sent_per_step']):>11} {fmt_bytes(sent):>11}{modelled}")
    return lines


def _server_lines(s: Summary) -> list[str]:
    """Each serving node's bytes over the run and what it holds (beside theory's), and the updates' staleness."""
    lines = []
    for role in serving(s):
        for n in role.measured:
            lines.append(f"{role.name} {n.get('index', '?')}: sent {fmt_bytes(n['sent'])}, received "
                         f"{fmt_bytes(n['received'])} over the run; holds {fmt_bytes(n['memory'].get('total'))} "
                         f"(predicted {fmt_bytes(role.mean('memory')[1])})")
    if s.get("staleness"):
        st = s["staleness"]
        lines.append(f"staleness histogram {st['histogram']} (mean {st['mean']:.2f}, max {st['max']})")
    return lines


def _fault_lines(s: Summary) -> list[str]:
    """The workers lost, the faults struck, the worlds restarted and what failures cost."""
    lines = []
    if s.get("lost_workers"):
        lines.append(f"lost workers: {s['lost_workers']}")
    for f in s.get("faults") or []:
        lines.append(f"fault: {f['node']} {f['action']} ({f['signal']}) as step {f['step']} began, at {f['at_s']:.2f} s"
                     + (f", continued at {f['resumed_at_s']:.2f} s" if "resumed_at_s" in f else ""))
    for r in s.get("restarts") or []:
        lines.append(f"restart: from step {r['from_step']} at {r['at_s']:.2f} s"
                     + (f", N = {r['world_size']}" if "world_size" in r else "")
                     + f" ({r['steps_lost']} step(s) done again) after: {r['error']}")
    lines += startup.report_lines(s["startup"]) if s.get("startup") else []
    if s.get("failure_cost"):
        lines += failure_cost_lines(s["failure_cost"])
    return lines


def _cluster_lines(s: Summary) -> list[str]:
    """An emulated cluster's step time measured beside predicted, and the bytes each node's link carried."""
    if not s.get("cluster", {}).get("emulated"):
        return []
    c, step = s["cluster"], s["cluster"]["step_time"]
    lines = [f"emulated cluster: alpha {c['alpha_s'] * 1e6:.0f} us; step time measured "
             f"{step['measured_s'] * 1e3:.2f} ms | predicted {step['predicted_s'] * 1e3:.2f} ms "
             f"(compute {step['compute_s'] * 1e3:.2f} ms)"]
    over = "the steps" if c.get("counted_over") == "steps" else "the whole run"
    for n in c["nodes"]:
        lines.append(f"  {n['role']} {n.get('rank', n.get('server'))} ({n['address']}, {n['link_mbps']:g} Mbit/s): "
                     f"link sent {fmt_bytes(n['link_sent'])}, received {fmt_bytes(n['link_received'])} over {over}")
    return lines


def dropped_line(d: dict[str, Any]) -> str:
    """report.txt's line for a worker the servers' rounds went on without (psarch.ps.servers_summary.dropped_workers)."""
    why = "its process died" if d["died"] else "no push within backend.timeout_s"
    back = f"re-admitted at round {d['readmitted_at']}" if d["readmitted_at"] is not None else "not re-admitted"
    return f"dropped: worker {d['worker']} from round {d['from_round']} ({why}), {back}"
