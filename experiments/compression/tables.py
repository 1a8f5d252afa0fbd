"""The compression study's tables and plot, from the run folders' summary.json and metrics.jsonl (README.md here):
    python experiments/compression/tables.py --update runs/compression experiments/compression/results TABLE FOLDER ...
reads results/<TABLE>.md back (TABLES: gpt, dlrm, gpt_geo) and puts the runs of runs/compression/<FOLDER>s in place
of its rows of the same N, link, arch and compression (or beside them), the other rows as written (their run folders
are gone), steps to target from the folders' loopback runs (with uncompressed ddp at N = 4, which fixes the target)
else from the table's rows, then writes the summary again (gpt and dlrm: summary.md and the plot);
    python experiments/compression/tables.py --hybrid runs/compression experiments/compression/results FOLDER ...
    python experiments/compression/tables.py --lora runs/compression experiments/compression/results FOLDER
write results/hybrid.md from the hybrid runs in the FOLDERs (one per link) and results/lora.md from the LoRA sweep's;
    python experiments/compression/tables.py runs/compression experiments/compression/results [TABLE ...]
builds each table from scratch from the folders <TABLE>_steps and <TABLE>_time (the first sweeps' names), and
refuses, writing nothing, where they hold no runs.

Time to target = the steps a loopback run of the same point took to reach the target (*_steps sweeps: a
synchronous run's arithmetic does not depend on the links) x the step time measured on the emulated cluster
(*_time sweeps; PowerSGD: its warm-up steps at their own measured median, then the compressed ones at theirs).
Predicted step time: the step simulator's, recomputed from each run folder with this checkout's theory
(psarch.theory.cluster_step, as `psarch report cluster` does: every compression's step is a program now; the
programs for compressed steps were written without these runs' figures); where a backend writes none, the serial
estimate written here before the runs: the modelled compute plus the busiest node's predicted bytes over its link,
nothing overlapped (marked "serial")."""
from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

from psarch.report.nodes import serving
from psarch.report.runs import Run, run_config
from psarch.theory import cluster_step
from psarch.units import fmt_bytes
from run_figures import (TARGET, WINDOW, compressed_prediction, link, measured_bytes, ms, phases, point,
                         predicted_step, runs_in, steps_to_target, wire_bytes, world)

# each compression table and its workload (whose target it takes): gpt_geo is the PS in GEO mode, which compresses
# its pulls too, run after the others (gpt_geo_steps.toml, gpt_geo_time.toml)
TABLES = {"gpt": "gpt", "dlrm": "dlrm", "gpt_geo": "gpt"}


def line_of(r: Run, reached: dict[tuple[str, str, int], int | None]) -> tuple[list, dict]:
    """One run's cells in its table (all but "vs none") and its row for the short table and the plot."""
    arch, comp = point(r)
    n = world(r)
    steps = reached.get((arch, comp, n), reached.get((arch, comp, 4), "missing"))
    from4 = (arch, comp, n) not in reached and (arch, comp, 4) in reached
    pred = compressed_prediction(r)
    p_s, how = predicted_step(r, pred)
    warm, warm_t, t = phases(r)
    sent, recv = measured_bytes(r)
    tt = None
    if isinstance(steps, int):
        tt = (min(steps, warm) * warm_t if warm_t else 0.0) + max(0, steps - warm) * t
    tr = pred["traffic_per_step"]
    vd = r["summary"]["virtual_device"]
    row = {"n": n, "link": link(r), "arch": arch, "comp": comp, "time": tt, "steps": steps, "step": t,
           "pred": p_s, "how": how, "sent": sent, "overrun": vd["overrun_fraction"]}
    st = f"{steps}{' (N=4)' if from4 else ''}" if steps is not None else "not reached"
    return [n, link(r), arch, comp, f"{ms(t)} \\| {ms(p_s)} ({how})",
            f"{fmt_bytes(sent)} \\| {fmt_bytes(tr['worker_sent'])}",
            f"{fmt_bytes(recv)} \\| {fmt_bytes(tr['worker_received'])}", fmt_bytes(wire_bytes(r)), st,
            "-" if tt is None else f"{tt:.2f}", f"D = {vd['dilation']:g}, {vd['overrun_fraction']:.0%}"], row


def vs_none(lines: list[list], rows: list[dict]) -> None:
    """Insert each line's time to target against ddp's uncompressed run at the same N and link."""
    for line, row in zip(lines, rows):
        none = next((x for x in rows if (x["n"], x["link"], x["arch"], x["comp"]) == (row["n"], row["link"], "ddp",
                                                                                      "none")), None)
        ratio = f"{row['time'] / none['time']:.2f}x" if row["time"] and none and none["time"] else "-"
        if "vs_written" in row and none and "vs_written" in none:   # both read back from a table: as written there
            ratio = row["vs_written"]
        row["vs"] = ratio
        line.insert(10, ratio)


def compression_table(root: Path, table: str) -> tuple[str, list[dict]]:
    workload = TABLES[table]
    steps_runs = runs_in(root / f"{table}_steps")
    time_runs = runs_in(root / f"{table}_time")
    if not steps_runs:
        return f"(no {table}_steps runs)\n", []
    target, reached = steps_to_target(steps_runs, workload)
    floor = steps_runs[0]["summary"]["entropy_floor"]
    head = (f"Target: {WINDOW}-step mean gap < {target:.4f} (loss {floor + target:.4f}; {TARGET[workload]} x the initial "
            f"gap of uncompressed ddp at N = 4).\n\n"
            "| N | link | arch | compression | step time (ms) measured \\| predicted | sent/step measured \\| formula "
            "| received/step measured \\| formula | on the wire/step (every step) | steps to target | time to target (s) | "
            "vs none | D, overrun |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows, lines = [], []
    for r in sorted(time_runs, key=lambda r: (world(r), link(r), point(r))):
        line, row = line_of(r, reached)
        lines.append(line)
        rows.append(row)
    vs_none(lines, rows)
    return head + body_of(lines), rows


def body_of(lines: list[list]) -> str:
    return "".join("| " + " | ".join(str(x) if not isinstance(x, float) else f"{x:g}" for x in line) + " |\n"
                   for line in lines)


UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}


def stored(path: Path) -> tuple[str, list[list], list[dict]]:
    """A table this script wrote, read back: its head, each point's cells (but "vs none") and its row, figures to the
    digits written; for tables whose older run folders are no longer on this machine."""
    text = path.read_text()
    cut = text.index("|---")
    cut = text.index("\n", cut) + 1
    lines, rows = [], []
    for t in text[cut:].splitlines():
        cells = t.strip()[2:-2].split(" | ")
        vs = cells.pop(10)   # vs none: recomputed where the row or its uncompressed row is new
        lines.append(cells)
        rows.append(dict(stored_row(cells), vs=vs, vs_written=vs))
    return text[:cut], lines, rows


def stored_row(cells: list[str]) -> dict:
    step, pred, how = re.fullmatch(r"(\S+) \\\| (\S+) \((\w+)\)", cells[4]).groups()
    value, unit = cells[5].split(" \\| ")[0].split(" ")
    first = cells[8].split(" ")[0]
    return {"n": int(cells[0]), "link": float(cells[1]), "arch": cells[2], "comp": cells[3],
            "time": None if cells[9] == "-" else float(cells[9]),
            "steps": int(first) if first.isdigit() else None if cells[8] == "not reached" else cells[8],
            "step": float(step) / 1e3, "pred": float(pred) / 1e3, "how": how, "sent": float(value) * UNITS[unit],
            "overrun": float(cells[-1].rsplit(", ", 1)[1].rstrip("%")) / 100}


def updated_table(root: Path, out: Path, table: str, folders: list[str]) -> tuple[str, list[dict]]:
    """results/<table>.md with the emulated runs in root/<folder>s in place of (or beside) its rows of the same N,
    link, arch and compression; steps to target from the folders' loopback runs, else from the table's own rows of
    the same point (N = 4's where N has none)."""
    head, lines, rows = stored(out / f"{table}.md")
    reached = {(r["arch"], r["comp"], r["n"]): r["steps"] for line, r in zip(lines, rows) if "(N=4)" not in line[8]}
    points = {(r["n"], r["link"], r["arch"], r["comp"]): (line, r) for line, r in zip(lines, rows)}
    runs = [run for folder in folders for run in runs_in(root / folder)]
    steps_runs = [run for run in runs if not run["config"]["cluster"].get("emulate")]
    if steps_runs:   # loopback runs of new points (with uncompressed ddp at N = 4 for the target): steps to target
        reached.update(steps_to_target(steps_runs, TABLES[table])[1])
    for line, r in zip(lines, rows):   # a row that took N = 4's steps, now measured at its N (no warm-up phase)
        steps = reached.get((r["arch"], r["comp"], r["n"]))
        if "(N=4)" in line[8] and isinstance(steps, int) and not r["comp"].startswith("PowerSGD"):
            r.update(steps=steps, time=steps * r["step"])
            r.pop("vs_written")
            line[8], line[9] = str(steps), f"{r['time']:.2f}"
    for run in runs:
        if run["config"]["cluster"].get("emulate"):
            line, r = line_of(run, reached)
            points[(r["n"], r["link"], r["arch"], r["comp"])] = (line, r)
    lines, rows = [list(points[k][0]) for k in sorted(points)], [points[k][1] for k in sorted(points)]
    vs_none(lines, rows)
    return head + body_of(lines), rows


def short_table(all_rows: dict[str, list[dict]]) -> str:
    """One line per workload, N and point: steps to target, then per link the step time (measured | predicted), the
    bytes a worker sent per step and the time to target against uncompressed ddp's at that link."""
    rates = sorted({r["link"] for rows in all_rows.values() for r in rows})
    head = "| workload | N | arch | compression | steps to target | " + " | ".join(
        f"{rate:g} Mbit/s: step (ms) meas. \\| pred. | sent/step | time to target (s) | vs none" for rate in rates) + " |"
    lines = [head, "|" + "---|" * (5 + 4 * len(rates))]
    for w, rows in all_rows.items():
        for key in sorted({(r["n"], r["arch"], r["comp"]) for r in rows}, key=lambda k: (k[0], k[2] != "none", k[2], k[1])):
            cells = []
            for rate in rates:
                r = next((x for x in rows if (x["n"], x["arch"], x["comp"], x["link"]) == (*key, rate)), None)
                if r is None:
                    cells += ["not run"] + [""] * 3
                    continue
                vs = f"**{r['vs']}**" if r["vs"] != "-" else "-"
                cells += [f"{ms(r['step'])} \\| {ms(r['pred'])}{'' if r['how'] == 'sim' else ' s'}", fmt_bytes(r["sent"]),
                          "-" if r["time"] is None else f"{r['time']:.2f}", vs]
            steps = next((r["steps"] for r in rows if (r["n"], r["arch"], r["comp"]) == key), "-")
            reached = steps if steps is not None else "not reached"
            lines.append(f"| {TABLES[w]} | {key[0]} | {key[1]} | {key[2]} | {reached} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(all_rows: dict[str, list[dict]], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(w, n) for w in all_rows for n in (4, 8) if any(r["n"] == n for r in all_rows[w])]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (w, n) in zip(axes[0], panels):
        rows = [r for r in all_rows[w] if r["n"] == n]
        names = sorted({(r["arch"], r["comp"]) for r in rows}, key=lambda p: (p[1] != "none", p))
        for j, rate in enumerate(sorted({r["link"] for r in rows})):
            by = {(r["arch"], r["comp"]): r for r in rows if r["link"] == rate}
            xs = [i + 0.4 * j for i in range(len(names))]
            ys = [by[p]["time"] or 0.0 if p in by else 0.0 for p in names]
            ax.bar(xs, ys, width=0.4, label=f"{rate / 1000:g} Gbit/s" if rate >= 1000 else f"{rate:g} Mbit/s")
            for x, y, p in zip(xs, ys, names):
                words = by[p]["vs"].strip("-") if y else "not\nreached" if p in by else "not\nrun"
                ax.text(x, y, words, ha="center", va="bottom", fontsize=6)
        ax.set_xticks([i + 0.2 for i in range(len(names))], [f"{a}\n{c}" for a, c in names], fontsize=7, rotation=45)
        ax.set_ylabel("time to target (s, cluster time)")
        ax.set_title(f"{w}, N = {n} (labels: time / uncompressed ddp's at that link)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "time_to_target.png", dpi=110)


def lora_table(folder: Path) -> str:
    runs = runs_in(folder)
    if not runs:
        return "(no lora runs)\n"
    lines = ["| backend | trainable params | frozen params | rank 0: params (trainable) | grads | optimizer | frozen "
             "| total measured \\| predicted | sent/step measured \\| predicted | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r["summary"]
        m, p = s["memory"]["per_rank"][0], s["predicted"]
        pm = p["per_rank"][0]["memory"] if p.get("per_rank") else p["memory_per_rank"]
        sent = statistics.fmean(t["sent_per_step"] for t in s["traffic"]["per_rank"])
        lines.append(f"| {s['label']}{' (full)' if not r['config']['train'].get('lora_rank') else ''} | "
                     f"{s['params']:,} | {s.get('frozen_params', 0):,} | "
                     f"{fmt_bytes(m['params'])} | {fmt_bytes(m['grads'])} | {fmt_bytes(m['optimizer'])} | "
                     f"{fmt_bytes(m.get('frozen', 0))} | {fmt_bytes(m['total'])} \\| {fmt_bytes(pm['total'])} | "
                     f"{fmt_bytes(sent)} \\| {fmt_bytes(p['traffic_per_step']['worker_sent'])} | {s['final_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def hybrid_table(folders: list[Path]) -> str:
    runs = [run for folder in folders for run in runs_in(folder)]
    if not runs:
        return "(no hybrid runs)\n"
    lines = ["| link | run | worker sent/step measured \\| predicted | received measured \\| predicted | server "
             "received/step | on the wire/step | step time (ms) measured \\| predicted | D, overrun |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (link(r), r["summary"]["label"])):
        s = r["summary"]
        sent, recv = measured_bytes(r)
        tr = s["predicted"]["traffic_per_step"]
        # one node of each serving role (the hybrid's PS servers): received per step, run total over the steps
        srv = "; ".join(fmt_bytes(m) for role in serving(s) if (m := role.mean("received")[0]) is not None) or "-"
        st, vd = s["cluster"]["step_time"], s["virtual_device"]
        st = dict(st, predicted_s=cluster_step(run_config(r), s)["predicted_s"])   # this checkout's theory
        lines.append(f"| {link(r):g} Mbit/s | {s['label']} | {fmt_bytes(sent)} \\| {fmt_bytes(tr['worker_sent'])} | "
                     f"{fmt_bytes(recv)} \\| {fmt_bytes(tr['worker_received'])} | {srv} | {fmt_bytes(wire_bytes(r))} | "
                     f"{ms(st['measured_s'])} \\| {ms(st.get('predicted_s'))} | D = {vd['dilation']:g}, "
                     f"{vd['overrun_fraction']:.0%} |")
    return "\n".join(lines) + "\n"


def update(root: Path, out: Path, table: str, folders: list[str]) -> None:
    """results/<table>.md updated with the runs in root/<folder>s, then its summary (summary.md and the plot for the
    first sweeps' tables, gpt and dlrm, read back from their files; else <table>_summary.md)."""
    if table not in TABLES or not folders:
        sys.exit(f"--update {table!r} {' '.join(folders)}: expected a table ({', '.join(TABLES)}) and run folders")
    text, rows = updated_table(root, out, table, folders)
    (out / f"{table}.md").write_text(text)
    print(f"## {table}\n\n{text}")
    if table != TABLES[table]:
        (out / f"{table}_summary.md").write_text(short_table({table: rows}))
        return
    all_rows = {w: rows if w == table else stored(out / f"{w}.md")[2] for w in TABLES if w == TABLES[w]}
    plot(all_rows, out)
    (out / "summary.md").write_text(short_table(all_rows))


def main() -> None:
    mode, args = (sys.argv[1], sys.argv[2:]) if sys.argv[1:2] and sys.argv[1].startswith("--") else ("", sys.argv[1:])
    if mode in ("--update", "--hybrid", "--lora") and len(args) < (4 if mode == "--update" else 3):
        sys.exit(f"{mode}: expected ROOT OUT {'TABLE ' if mode == '--update' else ''}FOLDER ... (see this script's help)")
    if mode == "--update":
        update(Path(args[0]), Path(args[1]), args[2], args[3:])
        return
    if mode in ("--hybrid", "--lora"):
        root, out, name = Path(args[0]), Path(args[1]), mode[2:]
        text = hybrid_table([root / f for f in args[2:]]) if name == "hybrid" else lora_table(root / args[2])
        if text.startswith("(no "):
            sys.exit(f"{mode}: no runs in {', '.join(args[2:])} under {root}: {out / name}.md left as it is")
        (out / f"{name}.md").write_text(text)
        print(text)
        return
    if mode or len(args) < 2:
        sys.exit(__doc__)
    root, out = Path(args[0]), Path(args[1])
    chosen = args[2:] or list(TABLES)
    unknown = [t for t in chosen if t not in TABLES]
    if unknown:
        sys.exit(f"table {unknown[0]!r}: expected one of {', '.join(TABLES)}")
    tables = {w: compression_table(root, w) for w in chosen}
    empty = [w for w, (_, rows) in tables.items() if not rows]
    if empty:
        sys.exit(f"no {empty[0]}_steps or {empty[0]}_time runs under {root}: nothing written (--update puts new runs "
                 f"in a stored table)")
    out.mkdir(parents=True, exist_ok=True)
    all_rows = {}
    for w, (text, all_rows[w]) in tables.items():
        (out / f"{w}.md").write_text(text)
        print(f"## {w}\n\n{text}")
    text = short_table(all_rows)
    if chosen != list(TABLES):
        for w in chosen:
            (out / f"{w}_summary.md").write_text(short_table({w: all_rows[w]}))
        print(f"## summary of {', '.join(chosen)}\n\n{text}")
        return
    plot(all_rows, out)
    (out / "summary.md").write_text(text)
    print(f"## summary\n\n{text}")


if __name__ == "__main__":
    main()
