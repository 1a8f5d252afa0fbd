"""What every plot of a report shares: one colour per configuration (the same in every plot), one line
style per world size, and how a figure is saved."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LINE_STYLES = ("-", "--", ":", "-.")


def configuration(name: str) -> str:
    """A run's configuration: its short name without the world size, so N = 2, 4, 8 share a colour."""
    return re.sub(r"-?world_size\d+", "", name).strip("-") or name


class Palette:
    """Colours and names for the runs of one report, computed once and passed to every plot."""

    def __init__(self, runs: list[dict[str, Any]]) -> None:
        self.names = [r["run_label"] for r in runs]   # the folder (or config label), psarch.runs.name_runs
        configs = list(dict.fromkeys(configuration(n) for n in self.names))
        # grey is left out: it draws references (the synchronous curve in other panels)
        colours = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7] if len(configs) <= 9 else \
            [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (14, 15)]
        self.colour_of = {c: colours[i % len(colours)] for i, c in enumerate(configs)}
        worlds = sorted({r["summary"]["world_size"] for r in runs})
        self.style_of_n = {n: LINE_STYLES[i % len(LINE_STYLES)] for i, n in enumerate(worlds)}
        self.several_n = len(worlds) > 1
        self._index = {id(r): i for i, r in enumerate(runs)}

    def name(self, run: dict[str, Any]) -> str:
        """The run's legend and tick name: its short name, with N where the name does not say it."""
        name, n = self.names[self._index[id(run)]], run["summary"]["world_size"]
        return name + (f" N={n}" if self.several_n and f"world_size{n}" not in name else "")

    def colour(self, run: dict[str, Any]) -> Any:
        return self.colour_of[configuration(self.names[self._index[id(run)]])]

    def line(self, run: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments of a run's line: its configuration's colour, its world size's style."""
        return {"color": self.colour(run), "ls": self.style_of_n[run["summary"]["world_size"]], "lw": 1.3}


def save(fig: Any, out: Path, name: str) -> str:
    """Write `name`.png at a size that reads at README width; returns the name."""
    if not fig.get_layout_engine():   # a plot that reserved room for a figure legend laid itself out
        fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=100)
    plt.close(fig)
    return name
