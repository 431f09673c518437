"""Human-readable numbers for tables, hovers and captions."""

from __future__ import annotations

import math

from backend.analytic.units import KiB

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "–"
    v, i = float(n), 0
    while abs(v) >= KiB and i < len(_BYTE_UNITS) - 1:
        v, i = v / KiB, i + 1
    return f"{v:,.0f} {_BYTE_UNITS[i]}" if i == 0 else f"{v:,.2f} {_BYTE_UNITS[i]}"


def fmt_bytes_short(n: float | None) -> str:
    """Three significant digits ('527 KiB', '2.78 MiB', '74.5 GiB'): for metrics, which cut long values off."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "–"
    v, i = float(n), 0
    while abs(v) >= KiB and i < len(_BYTE_UNITS) - 1:
        v, i = v / KiB, i + 1
    return f"{v:.3g} {_BYTE_UNITS[i]}" if abs(v) < 1000 else f"{v:,.0f} {_BYTE_UNITS[i]}"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_pct(p: float | None, digits: int = 1) -> str:
    return "–" if p is None else f"{p:+.{digits}f} %"


def fmt_frac(f: float | None) -> str:
    return "–" if f is None else f"{f * 100:.1f} %"


def fmt_count(n: float | None) -> str:
    if n is None:
        return "–"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:.0f}"


def fmt_count_short(n: float | None) -> str:
    """Three significant digits ('135k', '70.6B')."""
    if n is None:
        return "–"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"
