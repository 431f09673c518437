"""Operation tables (backend/analytic/steptime/op_tables.py): lookups by shape, and the shipped named tables are the
measured GPU-check probe (benchmarks/results/gpu/2026-11-26-h200-run1) and the cited publications, unaltered."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backend.analytic.steptime.op_tables import (
    AttentionRow,
    AttentionTable,
    GemmTable,
    table_json,
    tables_from_json,
    tables_from_measured,
)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = json.loads((ROOT / "backend" / "analytic" / "steptime" / "op_tables.json").read_text())["tables"]
PROBE = next(iter(json.loads((ROOT / "benchmarks" / "results" / "gpu" / "2026-11-26-h200-run1" / "profile.json")
                             .read_text())["profiles"].values()))

TABLE = GemmTable(rows=((1024, 1024, 1024, 0.25), (1024, 1024, 4096, 0.5), (4096, 4096, 4096, 0.8),
                        (2048, 2048, 2048, 0.6)))


def test_gemm_exact_rows_between_and_beyond():
    assert TABLE.efficiency(4096, 4096, 4096) == 0.8 and TABLE.efficiency(1024, 1024, 1024) == 0.25
    mid = TABLE.efficiency(3000, 3000, 3000)
    assert 0.25 < mid < 0.8
    assert TABLE.efficiency(65536, 65536, 65536) == 0.8  # clamped to the largest measured shape
    assert TABLE.efficiency(16, 16, 16) == 0.25


def test_gemm_arrays_equal_scalars():
    m, k, n = np.array([1024, 3000, 8192]), np.array([1024, 2048, 8192]), np.array([4096, 3000, 512])
    arr = TABLE.efficiency(m, k, n)
    assert (arr.shape == (3,)
            and list(arr) == [TABLE.efficiency(int(a), int(b), int(c)) for a, b, c in zip(m, k, n, strict=False)])


def test_attention_lookup_by_kernel_and_causality():
    t = AttentionTable(rows=(AttentionRow("flash", 4096, 64, True, 0.25, 0.22),
                             AttentionRow("cudnn", 4096, 128, False, 0.66, 0.55)))
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


@pytest.mark.parametrize("profile, kernel, tflops", [
    ("h100-sxm", "flash1", 108), ("a100-80gb-sxm", "flash1", 69), ("a100-80gb-sxm", "flash-triton", 68),
    ("a100-80gb-sxm", "flash", 155)])
def test_fa2_paper_attention_tables(profile, kernel, tflops):
    """Dao 2023 (FlashAttention-2), Fig. 7 (H100 80GB SXM5) and Fig. 4 (A100 80GB SXM4): forward + backward TFLOP/s at
    seq 2048, head dim 128, causal; FLOPs as the paper counts them (3.5 x the halved causal forward)."""
    from backend.analytic.steptime.hardware import get_hardware
    from backend.analytic.steptime.ops import attention_time
    hw = get_hardware(profile)
    fwd, bwd = attention_time(hw, "bf16-mixed", kernel, 4, 16, 2048, 128, causal=True)
    assert 3.5 * 4 * 4 * 16 * 2048 ** 2 * 128 / 2 / (fwd + bwd) / 1e12 == pytest.approx(tflops, rel=1e-3)


def test_h100_attention_joins_the_probe_and_the_paper():
    """h100-sxm lists three attention tables: flash / efficient / cudnn from the GPU-check probe, flash1 from the
    FlashAttention-2 paper's Fig. 7, flash3 from the FlashAttention-3 paper (issue 34); flash-triton (no H100 row)
    stands in as flash1; a kernel in two tables is refused."""
    from backend.analytic.steptime.hardware import get_hardware, merged_attention_tables
    from backend.analytic.steptime.ops import attention_efficiency
    hw = get_hardware("h100-sxm")
    assert set(hw.tables.attention.kernels()) == {"flash", "efficient", "cudnn", "flash1", "flash3"}
    assert attention_efficiency(hw, "flash-triton", 2048, 128) == attention_efficiency(hw, "flash1", 2048, 128)
    assert "GPU check" in hw.tables.attention.source and "Fig. 7" in hw.tables.attention.source
    row = {"kernel": "flash", "seq": 2048, "head_dim": 128, "causal": True, "fwd": 0.3, "bwd": 0.3}
    with pytest.raises(ValueError, match="in two of its tables"):
        merged_attention_tables("x", [{"rows": [row]}, {"rows": [row]}])
