"""Operation tables (backend/analytic/steptime/op_tables.py): lookups by shape, and the shipped named tables are the
measured GPU-check probe (benchmarks/results/gpu/2026-11-26-h200-run1) and the cited publications, unaltered."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backend.analytic.steptime.op_tables import (AttentionRow, AttentionTable, GemmTable, table_json,
                                                 tables_from_json, tables_from_measured)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = json.loads((ROOT / "backend" / "analytic" / "steptime" / "op_tables.json").read_text())["tables"]
PROBE = next(iter(json.loads((ROOT / "benchmarks" / "results" / "gpu" / "2026-11-26-h200-run1" / "profile.json")
                             .read_text())["profiles"].values()))

TABLE = GemmTable(rows=((1024, 1024, 1024, 0.25), (1024, 1024, 4096, 0.5), (4096, 4096, 4096, 0.8), (2048, 2048, 2048, 0.6)))


def test_gemm_exact_rows_between_and_beyond():
    assert TABLE.efficiency(4096, 4096, 4096) == 0.8 and TABLE.efficiency(1024, 1024, 1024) == 0.25
    mid = TABLE.efficiency(3000, 3000, 3000)
    assert 0.25 < mid < 0.8
    assert TABLE.efficiency(65536, 65536, 65536) == 0.8  # clamped to the largest measured shape
    assert TABLE.efficiency(16, 16, 16) == 0.25


def test_gemm_arrays_equal_scalars():
    m, k, n = np.array([1024, 3000, 8192]), np.array([1024, 2048, 8192]), np.array([4096, 3000, 512])
    arr = TABLE.efficiency(m, k, n)
    assert arr.shape == (3,) and list(arr) == [TABLE.efficiency(int(a), int(b), int(c)) for a, b, c in zip(m, k, n)]


def test_attention_lookup_by_kernel_and_causality():
    t = AttentionTable(rows=(AttentionRow("flash", 4096, 64, True, 0.25, 0.22), AttentionRow("cudnn", 4096, 128, False, 0.66, 0.55)))
    assert t.efficiency("flash", 4096, 64, True) == (0.25, 0.22)
    assert t.efficiency("cudnn", 4096, 128, True) == (0.66, 0.55)  # no causal row: the kernel's other rows
    assert t.efficiency("fa3", 4096, 128) is None


def test_shipped_gh100_tables_are_the_probe():
    """op_tables.json "gh100-probe-2026-11-26" = tables_from_measured of the committed H200 probe (GPU check
    2026-11-26 run 1), nothing edited by hand."""
    built = table_json(tables_from_measured(PROBE["measured"], PROBE["peak_flops"], PROBE["hbm_bytes_per_s"], "x"))
    shipped = SHIPPED["gh100-probe-2026-11-26"]
    assert shipped["gemm"]["bf16"]["rows"] == built["gemm"]["bf16"]["rows"]
    assert shipped["gemm"]["fp8"]["rows"] == built["gemm"]["fp8"]["rows"]
    assert shipped["attention"]["rows"] == built["attention"]["rows"]
    for part in ("elementwise", "optimizer"):
        assert shipped[part]["fractions"] == pytest.approx(built[part]["fractions"])
    launch = PROBE["measured"]["launch"]
    assert shipped["overhead"]["kernel_s"] == max(launch["device_s_per_kernel"], launch["host_s_per_launch"])


def test_shipped_tables_are_fractions_with_sources():
    for name, entry in SHIPPED.items():
        t = tables_from_json(entry)
        for dtype, g in t.gemm.items():
            assert g.source and all(0 < r[3] <= 1 for r in g.rows), (name, dtype)
        if t.attention:
            assert t.attention.source and all(0 < r.fwd <= 1 and 0 < r.bwd <= 1 for r in t.attention.rows), name
        assert all(0 < v <= 1 for v in {**t.elementwise, **t.optimizer}.values()), name
