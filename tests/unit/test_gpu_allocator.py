"""The GPU check's allocator phase (backend/gpucheck/allocator.py): the bisection that finds the smallest memory cap a
step runs under, and what the phase records where there is no CUDA allocator to measure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.gpucheck.allocator import MODES, allocator_phase, line
from backend.gpucheck.allocator_probe import smallest_cap
from backend.gpucheck.kit_context import KitContext

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("need", [100.0, 100.4, 130.0, 149.9])
def test_the_bisection_finds_the_smallest_cap_to_its_resolution(need):
    """Between the peak allocated (100: never enough) and the peak reserved (150: enough), six tries find the need
    within (150 - 100) / 2^6, from above: the cap it reports always ran."""
    ran: list[float] = []

    def fits(cap: float) -> bool:
        ran.append(cap)
        return cap >= need

    cap, log = smallest_cap(fits, 100.0, 150.0, 6)
    assert need <= cap <= need + 50 / 2**6 and len(log) == len(ran) == 6
    assert all(row["fits"] == (row["cap_bytes"] >= need) for row in log)
    assert cap == 150.0 or any(row["fits"] and row["cap_bytes"] == cap for row in log)


def test_the_child_says_why_it_measures_nothing_off_cuda():
    out = subprocess.run([sys.executable, "-m", "backend.gpucheck.allocator_probe", "--device", "cpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["status"] == "skipped" and "CUDA" in row["reason"]


def test_the_phase_runs_both_allocator_settings_and_reports_each(tmp_path):
    ctx = KitContext(device="cpu", nproc=1, out=tmp_path, work=tmp_path, check_id="t")
    rows = allocator_phase(ctx, 60.0)
    assert [r["alloc_conf"] for r in rows] == list(MODES) == ["", "expandable_segments:True"]
    assert all(r["status"] == "skipped" and "CUDA" in line(r) for r in rows)
    ok = {"status": "ok", "peak_allocated_bytes": 2**30, "reserve_slack": 0.097, "needed_slack": 0.02,
          "resolution_bytes": 2**24}
    assert line(ok) == "peak allocated 1.00 GiB, reserved +9.7%, needed under a cap +2.0% (+/- 0.02 GiB)"
