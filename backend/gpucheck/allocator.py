"""The GPU check's allocator phase (report.json key `allocator`): the caching allocator's slack as a reserve and as
a need, with the default allocator and with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (what Megatron-Bridge's
and torchtitan's launch scripts set), each in a child of its own (backend/gpucheck/allocator_probe.py; the setting
must be in the environment before torch starts).

What it settles: `estimate` prices the slack at 0.13 of the fullest moment, the reserve measured at world 1 without
memory pressure; the published multi-rank runs imply more (benchmarks/allocator_slack.py), and a layout whose only
excess is that slack is called tight (analytic/device.fit_verdict) because under pressure the allocator frees its
cached blocks and retries. `needed_slack` is what a step needs under pressure; `reserve_slack` what it reserves
without."""

from __future__ import annotations

import time
from typing import Any

from backend.gpucheck.kit_context import KitContext
from backend.gpucheck.phases import child_env, child_row, run_child

MODES = ("", "expandable_segments:True")
"""PYTORCH_CUDA_ALLOC_CONF per child: torch's default allocator, then expandable segments."""
CHILD_MAX_S = 120.0
"""A 1B set-up (~25 s on an H200) and eight steps of ~0.3 s, with margin."""


def allocator_phase(ctx: KitContext, budget_s: float) -> list[dict[str, Any]]:
    end = time.monotonic() + budget_s
    rows: list[dict[str, Any]] = []
    for conf in MODES:
        left = end - time.monotonic()
        if left < 20:
            rows.append({"status": "skipped", "alloc_conf": conf, "reason": f"{left:.0f} s left"})
            continue
        env = child_env() | {"PYTORCH_CUDA_ALLOC_CONF": conf}
        rc, out, err = run_child([ctx.python, "-m", "backend.gpucheck.allocator_probe", "--device", ctx.device],
                                 min(left, CHILD_MAX_S), env=env)
        rows.append({"alloc_conf": conf, **child_row(rc, out, err)})
        ctx.progress(f"allocator {conf or 'default'}: {line(rows[-1])}")
        ctx.save()
    return rows


def line(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return f"{row.get('status')}: {str(row.get('error') or row.get('reason'))[:300]}"
    return (f"peak allocated {row['peak_allocated_bytes'] / 2**30:.2f} GiB, reserved +{row['reserve_slack']:.1%}, "
            f"needed under a cap +{row['needed_slack']:.1%} (+/- {row['resolution_bytes'] / 2**30:.2f} GiB)")
