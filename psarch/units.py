"""Figures written for people: the one byte formatter every report and progress line uses (binary units), and
the decimal sizes and times of `psarch estimate`'s tables and plan."""
from __future__ import annotations


def fmt_bytes(n: float | None) -> str:
    """Bytes for people, in binary units: B, KiB, MiB, GiB, TiB; '-' for a figure nobody measured."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


SIZES = (("B", 1.0), ("KB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12))   # decimal, as the ZeRO paper's GB
TIMES = (("us", 1e-6), ("ms", 1e-3), ("s", 1.0))


def size_unit(values: list[float]) -> tuple[str, float]:
    """The unit a table of byte counts is printed in: the largest whose scale its largest value reaches, so
    that every cell reads with 3 significant figures (a run of 4,000 parameters in KB, a 7.5B model in GB)."""
    return unit_for(values, SIZES)


def unit_for(values: list[float], units: tuple[tuple[str, float], ...]) -> tuple[str, float]:
    top = max((abs(v) for v in values), default=0.0)
    fits = [u for u in units if top >= u[1]]
    return fits[-1] if fits else units[0]


def in_unit(x: float, scale: float) -> str:
    """x in a unit of `scale`, to 3 significant figures (0 as 0)."""
    return f"{x / scale:.3g}" if x else "0"


def fmt_size(x: float) -> str:
    """One byte count for people: 3 significant figures in B, KB, MB, GB or TB (1e3 steps) by its magnitude."""
    name, scale = size_unit([x])
    return f"{in_unit(x, scale)} {name}"


def fmt_time(t: float) -> str:
    """Seconds for people: 3 significant figures in us, ms or s by their magnitude."""
    name, scale = unit_for([t], TIMES)
    return f"{in_unit(t, scale)} {name}"
