"""The GPU check's power phase (report.json key `power`): each kernel class's draw and SM clock at the GPU's own power
limit, in a child of its own (backend/gpucheck/power_probe.py, which says what it settles)."""

from __future__ import annotations

from typing import Any

from backend.gpucheck.kit_context import KitContext
from backend.gpucheck.phases import child_row, run_child

CHILD_MAX_S = 90.0
"""CUDA start-up (~15 s), the idle sample, four workloads of 1 s warm-up + 4 s timed, with margin."""


def power_phase(ctx: KitContext, budget_s: float) -> dict[str, Any]:
    seconds = 4.0 if budget_s >= 45 else 2.0
    rc, out, err = run_child([ctx.python, "-m", "backend.gpucheck.power_probe", "--device", ctx.device,
                              "--seconds", str(seconds)], min(budget_s, CHILD_MAX_S))
    row = child_row(rc, out, err)
    ctx.progress(f"power: {line(row)}")
    return row


def line(row: dict[str, Any]) -> str:
    """One line per report: each kernel's draw, clock and rate, or why nothing was measured."""
    if row.get("status") != "ok":
        return f"{row.get('status')}: {str(row.get('error') or row.get('reason'))[:300]}"
    idle = row.get("idle") or {}
    parts = [f"idle {_num(idle.get('power_w'))} W"]
    for k in row.get("kernels") or []:
        if k.get("status") != "ok":
            parts.append(f"{k.get('name')} failed")
            continue
        rate = k["achieved_per_s"] / 1e12
        unit = "TFLOP/s" if k["unit"] == "flop/s" else "TB/s"
        parts.append(f"{k['name']} {_num(k.get('power_w'))} W at {_num(k.get('sm_mhz'))} MHz, {rate:.1f} {unit}")
    return "; ".join(parts)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"
