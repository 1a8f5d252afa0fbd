"""Do a study's committed byte, memory and synchronous-loss figures regenerate from its config as it is now?

    python experiments/reproduce/check.py architectures [scaling_memory ...] [--runs DIR]

Runs each chosen study's config (into DIR, default a fresh temporary folder; points already finished there are
skipped, as any sweep skips them), then compares its compare report with the committed one, cell by cell, in the
columns that do not depend on the machine: model states per rank, bytes sent per worker and received per server
per step, and the final loss of the synchronous runs (asynchronous runs' losses depend on timing, times on the
machine). Prints every cell compared and exits 1 if any differs or is missing.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPERIMENTS = HERE.parent

# study: (config, the committed report, extra arguments to psarch run)
STUDIES = {
    "architectures": ("architectures/architectures.toml", "architectures/results/report.md", []),
    "scaling_memory": ("scaling/memory_scaling.toml", "scaling/results/memory/report.md", []),
    "scaling_traffic": ("scaling/traffic_scaling.toml", "scaling/results/traffic/report.md", []),
}
EXACT = ("model states/rank", "sent/worker/step", "server recv/step")
ASYNC = ("async", "geo", "ssp")


def table(report: Path) -> dict[str, dict[str, str]]:
    """The first table of a compare report: {point name: {column: cell}}; a point is the run's last path part."""
    lines = [line for line in report.read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split(" | ")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        if len(cells) != len(header):
            break                                 # the next table
        row = dict(zip(header, cells))
        rows[row["run"].rsplit("/", 1)[-1]] = row
    return rows


def columns(row: dict[str, str]) -> list[str]:
    keep = [c for c in row if c.startswith(EXACT)]
    what = f"{row.get('variant', '')} {row.get('architecture', '')}"      # reports before and after "architecture"
    if not any(mode in what.replace("/", " ").split() for mode in ASYNC):
        keep += [c for c in row if c.startswith("final loss")]
    return keep


def cell(row: dict[str, str], column: str) -> str:
    """`column`'s cell, or that of the column it was renamed to ("final loss" -> "final loss (last step)")."""
    return next((row[c] for c in row if c == column or c.startswith(column + " (")), "(missing)")


def compare(committed: Path, fresh: Path) -> tuple[int, int]:
    old, new = table(committed), table(fresh)
    same = total = 0
    for point, row in old.items():
        for column in columns(row):
            total += 1
            now = cell(new.get(point, {}), column)
            ok = now == row[column]
            same += ok
            print(f"{'same' if ok else 'DIFFERS'}  {point:<45} {column:<45} {row[column]}" +
                  ("" if ok else f"  now {now}"))
    return same, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="+", choices=sorted(STUDIES))
    parser.add_argument("--runs", type=Path, help="where the runs go (default: a new temporary folder)")
    args = parser.parse_args(argv)
    runs = args.runs or Path(tempfile.mkdtemp(prefix="psarch-reproduce-"))
    failed = 0
    for study in args.studies:
        config, committed, extra = STUDIES[study]
        out = runs / study
        subprocess.run([sys.executable, "-m", "psarch.cli", "run", str(EXPERIMENTS / config), "--out", str(out),
                        "--quiet", *extra], check=True)
        same, total = compare(EXPERIMENTS / committed, out / "compare" / "report.md")
        print(f"== {study}: {same} of {total} cells identical ({out})")
        failed += same != total
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
