"""What every plot of a report shares: one colour per configuration (the same in every plot), one line
style (bar hatch) per world size, runs named by their run_label (folder or config `label`), legends beside
or below the data and never on it, and how a figure is saved."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence, TypedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.artist import Artist  # noqa: E402

from psarch.report.runs import Run  # noqa: E402

LINE_STYLES = ("-", "--", ":", "-.")
HATCHES = ("", "//", "..", "xx")


def configuration(name: str) -> str:
    """A run's configuration: its short name without the world size, so N = 2, 4, 8 share a colour."""
    return re.sub(r"-?world_size\d+", "", name).strip("-") or name


def _listed_colours(name: str) -> Sequence[Any]:
    """The colours of a qualitative colormap (tab10, tab20), which matplotlib keeps as a ListedColormap."""
    # the stub types get_cmap as returning a Colormap, which has no `colors`; these names are ListedColormaps
    return plt.get_cmap(name).colors  # type: ignore[attr-defined]


class LineStyle(TypedDict):
    """Keyword arguments of a run's line (Palette.line)."""

    color: Any                   # a matplotlib colour
    ls: str
    lw: float


class Palette:
    """Colours and names for the runs of one report, computed once and passed to every plot."""

    def __init__(self, runs: list[Run]) -> None:
        self.names = [r["run_label"] for r in runs]   # the folder (or config label), psarch.report.runs.name_runs
        configs = list(dict.fromkeys(configuration(n) for n in self.names))
        # grey is left out: it draws references (the synchronous curve in other panels)
        colours = [c for i, c in enumerate(_listed_colours("tab10")) if i != 7] if len(configs) <= 9 else \
            [c for i, c in enumerate(_listed_colours("tab20")) if i not in (14, 15)]
        self.colour_of = {c: colours[i % len(colours)] for i, c in enumerate(configs)}
        worlds = sorted({r["summary"]["world_size"] for r in runs})
        self.style_of_n = {n: LINE_STYLES[i % len(LINE_STYLES)] for i, n in enumerate(worlds)}
        self.several_n = len(worlds) > 1
        self._index = {id(r): i for i, r in enumerate(runs)}

    def name(self, run: Run) -> str:
        """The run's legend and tick name: its short name, with N where the name does not say it."""
        name, n = self.names[self._index[id(run)]], run["summary"]["world_size"]
        return name + (f" N={n}" if self.several_n and f"world_size{n}" not in name else "")

    def colour(self, run: Run) -> Any:
        return self.colour_of[configuration(self.names[self._index[id(run)]])]

    def line(self, run: Run) -> LineStyle:
        """Keyword arguments of a run's line: its configuration's colour, its world size's style."""
        return {"color": self.colour(run), "ls": self.style_of_n[run["summary"]["world_size"]], "lw": 1.3}

    def hatch(self, run: Run) -> str:
        """A run's bar hatch: its world size's, as line() gives its line style."""
        return HATCHES[LINE_STYLES.index(self.style_of_n[run["summary"]["world_size"]])]


def _entries(axes: list[Any]) -> dict[str, Artist]:
    """Each label of these axes' artists once, with its first handle."""
    keep: dict[str, Artist] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            keep.setdefault(label, handle)
    return keep


def legend_beside(fig: Any, axes: list[Any]) -> Any:
    """One legend for these axes, outside them on the right: never on the data, however many runs (two
    columns past 24 entries). The figure needs layout="constrained" to make room for it."""
    keep = _entries(axes)
    return fig.legend(keep.values(), keep.keys(), loc="outside right upper", fontsize=7,
                      ncol=1 if len(keep) <= 24 else 2)


def legend_below(fig: Any, axes: list[Any], extra: dict[str, Artist] | None = None) -> Any:
    """One legend for these axes (and `extra` label: handle entries) under them, outside the data
    (layout="constrained"), in as many columns as fit the figure's width."""
    keep = dict(_entries(axes), **(extra or {}))
    chars = fig.get_figwidth() * 13   # characters of 8-point text an inch, less the handles' room
    ncol = len(keep) if sum(len(k) + 6 for k in keep) <= chars else \
        max(1, int(chars // (max(map(len, keep), default=1) + 6)))
    return fig.legend(keep.values(), keep.keys(), loc="outside lower center", fontsize=8, ncol=max(1, ncol),
                      frameon=False, handleheight=1.5, handlelength=2.5)


def save(fig: Any, out: Path, name: str) -> str:
    """Write `name`.png at a size that reads at README width; returns the name."""
    if not fig.get_layout_engine():   # a plot that reserved room for a figure legend laid itself out
        fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=100)
    plt.close(fig)
    return name
