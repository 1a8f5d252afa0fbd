"""The failures study's table and plot, from the run folders' summary.json (README.md here):
    python experiments/failures/report.py runs/failures [OUT]
writes table.md, goodput.png and points.json (the figures each row is made of) into OUT (default results/)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt   # noqa: E402
import torch   # noqa: E402

from psarch.launch.lifecycle import TICK_S   # noqa: E402
from psarch.theory import failures   # noqa: E402

HERE = Path(__file__).parent / "results"


def load(folder: Path) -> dict:
    s = json.loads((folder / "summary.json").read_text())
    cfg = json.loads((folder / "config.json").read_text())
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()] \
        if (folder / "metrics.jsonl").exists() else []
    return {"folder": folder, "label": s.get("label") or s["backend"], "status": s.get("status"),
            "error": s.get("error"), "every": cfg["train"]["checkpoint_every"], "steps": s.get("steps"),
            "final_loss": s.get("final_loss"), "ended_at_s": s.get("ended_at_s"), "stopped_at_s": s.get("stopped_at_s"),
            "d": s.get("dilation") or s.get("virtual_device", {}).get("dilation", 1.0), "timeout_s": cfg["backend"].get("timeout_s"),
            "step_time_s": s.get("step_time_s"), "faults": s.get("faults", []), "worlds": s.get("worlds", []),
            "failure_cost": s.get("failure_cost"), "step_times": {r["step"]: r["step_time_s"] for r in rows},
            "lost_workers": [w["rank"] for w in s.get("lost_workers", [])], "wall_s": s.get("cluster", {}).get("wall_s")}


def points(root: Path) -> list[dict]:
    return [load(f.parent) for f in sorted(root.glob("**/summary.json"))]


def err(m: float | None, p: float | None) -> str:
    return f"{(m - p) / p * 100:+.0f}%" if m is not None and p else "?"


def same_model(p: dict, base: dict | None) -> str:
    """Whether the run's model.pt equals the no-fault run's, bit for bit (SGD, the same data seen)."""
    if base is None or not (p["folder"] / "model.pt").exists() or not (base["folder"] / "model.pt").exists():
        return "?"
    a, b = (torch.load(x["folder"] / "model.pt", weights_only=True) for x in (p, base))
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    return "bit-equal" if all(torch.equal(a[k], b[k]) for k in a) else f"max diff {diff:.1e}"


def loss(base: dict | None) -> str:
    return f"{base['final_loss']:.4f}" if base else "?"


def s3(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "?"


def first_world_model(p: dict, r: dict) -> float | None:
    """The time lost the first model predicted (before 2026-11-28): one tick of detection and the first world's own
    launch to first step as the restart's start-up, beside the same recomputation; None where the run has no first
    world's start-up or no predicted recomputation."""
    w = p["worlds"][0] if p["worlds"] else {}
    if w.get("first_step_at_s") is None or r["recompute_predicted_s"] is None:
        return None
    return TICK_S / p["d"] + w["first_step_at_s"] - w["launched_at_s"] + r["recompute_predicted_s"]


def collective_row(p: dict, base: dict | None) -> tuple[str, dict]:
    c = p["failure_cost"]
    [r] = c["restarts"]
    m, q, old = r["time_lost_s"], r["time_lost_predicted_s"], first_world_model(p, r)
    row = (f"| {p['label']} | {p['every']} | {c['goodput_steps_per_s']:.2f} | {s3(m)} \\| {s3(q)} ({err(m, q)}) | "
           f"{s3(old)} ({err(m, old)}) | "
           f"{s3(r['detection_s'])} \\| {s3(r['detection_predicted_s'])} | {s3(r['relaunch_s'])} \\| - | "
           f"{s3(r['startup_s'])} \\| {s3(r['startup_predicted_s'])} | {s3(r['recompute_s'])} \\| "
           f"{s3(r['recompute_predicted_s'])} | {r['steps_lost']} \\| {r['steps_lost_predicted']} | "
           f"{p['final_loss']:.4f} \\| {loss(base)} ({same_model(p, base)}) |")
    return row, {"label": p["label"], "every": p["every"], "goodput": c["goodput_steps_per_s"], "time_lost_s": m,
                 "time_lost_predicted_s": q, "first_world_model_s": old,
                 "mean_time_lost_predicted_s": c["mean_time_lost_predicted_s"],
                 "restart": r, "worlds": p["worlds"], "final_loss": p["final_loss"], "d": p["d"],
                 "model_vs_no_fault": same_model(p, base),
                 "wall_s": p["wall_s"]}


def ps_worker_row(p: dict, base: dict | None) -> tuple[str, dict]:
    """PS sync goes on at N - 1, no restart, no step done again: the round of the fault's step waits until the dead
    worker is dropped. Killed: the launcher sees its exit within a tick and tells the servers at once (TICK_S / D);
    stopped (hung, no exit to see): the servers drop it after backend.timeout_s (the cluster's seconds). Measured:
    that step's time less the run's median step."""
    [f] = p["faults"]
    killed = f["action"] == "kill"
    m = p["step_times"][f["step"]] - p["step_time_s"]
    detection = TICK_S / p["d"] if killed else p["timeout_s"]
    q = failures.time_lost(detection, 0.0, 0, p["step_time_s"])
    goodput = p["steps"] / p["ended_at_s"]
    what = "worker killed" if killed else f"worker stopped {f['seconds']:g} s"
    row = (f"| {p['label']} ({what}, goes on at N - 1) | - | {goodput:.2f} | {m:.4f} \\| {q:.4f} ({err(m, q)}) | - "
           f"| {m:.4f} \\| {q:.4f} | - | - | - | 0 \\| 0 | {p['final_loss']:.4f} \\| {loss(base)} |")
    return row, {"label": p["label"], "fault": f, "goodput": goodput, "time_lost_s": m, "time_lost_predicted_s": q,
                 "final_loss": p["final_loss"], "lost_workers": p["lost_workers"], "d": p["d"]}


def ps_server_row(p: dict) -> tuple[str, dict]:
    [k] = [f for f in p["faults"] if f["action"] == "kill"]
    m = round(p["stopped_at_s"] - k["at_s"], 6) if p["stopped_at_s"] is not None else None
    q = TICK_S / p["d"]
    row = (f"| {p['label']} (server 1 killed, r = 0) | - | stops: `{p['error']}` | - | - | {s3(m)} \\| {q:.3f} | - | - "
           f"| - | - | - |")
    return row, {"label": p["label"], "status": p["status"], "error": p["error"], "detection_s": m,
                 "detection_predicted_s": q, "steps": len(p["step_times"]), "wall_s": p["wall_s"]}



def ps_server_r1_row(p: dict, base: dict | None) -> tuple[str, dict]:
    """PS sync with backend.replicas = 1, server 1 killed: its workers had sent every round to its replica too, which
    applied it, so nothing is redone and nothing waited for: predicted time lost 0 (a worker learns of the death
    at its next wait, from the connection the kernel closed, and takes the reply the replica already sent).
    Measured: the kill step's time less the run's median step."""
    [k] = [f for f in p["faults"] if f["action"] == "kill"]
    m = p["step_times"][k["step"]] - p["step_time_s"]
    goodput = p["steps"] / p["ended_at_s"]
    times = sorted(p["step_times"].values())
    row = (f"| {p['label']} (server 1 killed, r = 1, fails over) | - | {goodput:.2f} | {m:.4f} \\| 0 (steps "
           f"{times[0]:.4f}-{times[-1]:.4f}) | - | - | - | - | - | 0 \\| 0 | {p['final_loss']:.4f} \\| {loss(base)} "
           f"({same_model(p, base)}) |")
    return row, {"label": p["label"], "fault": k, "goodput": goodput, "time_lost_s": m, "time_lost_predicted_s": 0.0,
                 "final_loss": p["final_loss"], "model_vs_no_fault": same_model(p, base), "d": p["d"]}

HEAD = ("| architecture | checkpoint every | goodput (steps/s) | time lost (s) measured \\| predicted (error) | "
        "old model: tick + first world's start-up (error) | detection | relaunch | start-up | recompute | steps lost "
        "| final loss \\| no fault (model) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|")


def main(root: Path, here: Path = HERE) -> None:
    here.mkdir(exist_ok=True)
    data: dict = {"baseline": {}, "collectives": []}
    lines = [HEAD]
    for folder in sorted(root.glob("collectives*")):   # collectives (D auto per point), collectives_d32 (D = 32)
        tag = folder.name.removeprefix("collectives") or "_auto"
        base = {p["label"]: p for p in points(root / f"baseline{folder.name.removeprefix('collectives')}")}
        for k, v in base.items():
            data["baseline"][f"{k}{tag}"] = {"goodput": v["steps"] / v["ended_at_s"], "final_loss": v["final_loss"],
                                             "d": v["d"], "label": k, "set": tag}
        for p in sorted(points(folder), key=lambda p: (p["label"], p["every"])):
            row, d = collective_row(p, base.get(p["label"])) if p["failure_cost"] else (
                f"| {p['label']} | {p['every']} | {p['status']}: {p['error']} |", {"label": p["label"]})
            lines.append(row.replace(f"| {p['label']} |", f"| {p['label']} (D = {p['d']:g}) |", 1))
            data["collectives"].append(dict(d, set=tag))
    base = {p["label"]: p for p in points(root / "baseline")}
    for name, rowf in (("ps_worker", ps_worker_row), ("ps_hung", ps_worker_row), ("ps_server", None)):
        for p in points(root / name):
            row, d = rowf(p, base.get(p["label"])) if rowf else ps_server_row(p)
            lines.append(row.replace(f"| {p['label']} (", f"| {p['label']} (D = {p['d']:g}, ", 1))
            data[name] = d
    for p in points(root / "ps_server_r1"):
        row, data["ps_server_r1"] = ps_server_r1_row(p, base.get(p["label"]))
        lines.append(row.replace(f"| {p['label']} (", f"| {p['label']} (D = {p['d']:g}, ", 1))
    for k, v in data["baseline"].items():
        lines.append(f"| {v['label']}, no fault (D = {v['d']:g}) | - | {v['goodput']:.2f} | - | - | - | - | - | - | - | "
                     f"{v['final_loss']:.4f} |")
    (here / "table.md").write_text("\n".join(lines) + "\n")
    (here / "points.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    plot(data, here)
    print("\n".join(lines))


def plot(data: dict, here: Path) -> None:
    """Goodput against the checkpoint interval, from the points whose start-up was paced where there are (the
    cluster's own), else at one fixed D (in the cluster's time a start-up on this host counts 1/D: points at different
    D do not compare)."""
    tag = next((t for t in ("_paced", "_d32") if any(c.get("set") == t for c in data["collectives"])), "_auto")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = [c for c in data["collectives"] if c.get("set") == tag and "goodput" in c]
    for label in sorted({c["label"] for c in pts}):
        xy = sorted((c["every"], c["goodput"]) for c in pts if c["label"] == label)
        line, = ax.plot([x for x, _ in xy], [y for _, y in xy], "o-", label=f"{label}, worker 2 killed at step 17")
        if f"{label}{tag}" in data["baseline"]:
            ax.axhline(data["baseline"][f"{label}{tag}"]["goodput"], color=line.get_color(), ls=":", lw=1)
    ax.set_xlabel("checkpoint interval (steps)")
    ax.set_ylabel("goodput (steps / s, the cluster's time)")
    d = {"_paced": "the start-up paced (faults.startup_s)", "_d32": "D = 32"}.get(tag, "D auto per point")
    ax.set_title(f"Goodput under one failure, N = 4, {d}\n(dotted: the same backend without a fault)", fontsize=10)
    ax.set_xticks(sorted({c["every"] for c in pts}))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(here / "goodput.png", dpi=120)


if __name__ == "__main__":
    if sys.argv[1] == "--plot":   # the plot again from a table's points.json: report.py --plot results/paced
        plot(json.loads((Path(sys.argv[2]) / "points.json").read_text()), Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else HERE)
