"""Figures written for people: the one byte formatter every report and progress line uses."""
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
