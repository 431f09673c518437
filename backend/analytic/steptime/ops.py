"""Seconds of one operation on a profile, from its operation tables (op_tables.py) where it has them, else from its
scalar tunables (pure Python + numpy; sizes may be arrays, one entry per layout).

- GEMM: FLOPs / (dtype peak x table efficiency(m, k, n) x gemm_scale), that rate at most the profile's
  power-limited `sustained_flops`, at least the bytes it moves at the copy bandwidth (roofline, Williams et al. 2009
  Sec 2). Without a table: gemm_efficiency_max x the measured CPU size
  curve or the saturating F / (F + gemm_half_flops), plus one kernel floor.
- fused attention: FlashAttention-2's FLOP count (Dao 2023 Sec 4.1: forward 4·b·a·s²·d, halved when causal since
  masked blocks are skipped; backward 2.5x the forward) / (peak x the kernel's table efficiency x attention_scale).
- element-wise kernels: each max(bytes / (HBM peak x its class's fraction), kernel floor).
- optimizer: AdamW's 28 B per element at the implementation's measured fraction of the HBM peak.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.scalar_or_array import is_array, maximum, minimum
from backend.analytic.steptime.elementwise import Pass
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.op_tables import ADAMW_BYTES_PER_PARAM, per_unique
from backend.analytic.traffic import FP8_BYTES

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num

FLASH_BWD_FACTOR = 2.5  # FlashAttention-2 (Dao 2023) Sec 3.1: backward 5 matmuls / forward 2
PRECISION_DTYPE = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp32": "fp32", "fp8": "bf16"}
"""The matmul dtype of a precision; fp8 runs all but its float8 linears in bf16 (those: `float8_gemm_time`)."""
FP8_ROWWISE = "fp8_rowwise"
"""The operation table of rowwise-scaled fp8 GEMMs (op_probe's gemm_fp8_rowwise): fp8 operands and peak."""
OPTIMIZER_IMPL = {"torch": "foreach", "fused": "fused", "compiled": "foreach"}
FALLBACK = {"flash-triton": ("flash1",)}
"""Attention kernels a profile's table may lack, and the measured kernel that stands in (attention_efficiency)."""
"""AdamW implementation by element-wise implementation: torch's default on CUDA (foreach), Megatron's fused Adam."""


def gemm_efficiency(hw: Hardware, dtype: str, m: Num, k: Num, n: Num, table_key: str | None = None) -> Num:
    """Fraction of the dtype's peak a (m, k) x (k, n) GEMM reaches on `hw` (module docstring); `table_key`: the
    profile's table to read when it is not the dtype's own (FP8_ROWWISE)."""
    table = hw.tables.gemm_table(table_key or dtype)
    if table is not None:
        return table.efficiency(m, k, n) * hw.tune.gemm_scale
    top = hw.tune.gemm_fp8_efficiency_max if dtype == "fp8" and hw.tune.gemm_fp8_efficiency_max else \
        hw.tune.gemm_efficiency_max
    flops = 2 * m * k * n
    if hw.gemm_curve:
        frac = np.vectorize(lambda f: curve_fraction(hw.gemm_curve, f))(flops) if is_array(flops) else \
            curve_fraction(hw.gemm_curve, flops)
    else:
        frac = flops / (flops + hw.tune.gemm_half_flops)
    return top * frac * hw.tune.gemm_scale


def curve_fraction(curve: tuple[tuple[float, float], ...], flops: float) -> float:
    """Fraction of peak of a GEMM of `flops` from a measured size curve: linear in log(FLOPs) between sizes, the end
    values outside them (Calculon, Isaev et al. SC'23 Sec 4: measured per-size efficiency tables)."""
    if flops <= curve[0][0]:
        return curve[0][1]
    for (f0, e0), (f1, e1) in zip(curve, curve[1:], strict=False):
        if flops <= f1:
            w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return e0 + w * (e1 - e0)
    return curve[-1][1]


def gemm_time(hw: Hardware, precision: str, m: Num, k: Num, n: Num, dtype_bytes: float) -> Num:
    """Seconds of one (m, k) x (k, n) GEMM in the matmul dtype of `precision` (module docstring)."""
    return dtype_gemm_time(hw, PRECISION_DTYPE.get(str(precision), str(precision)), m, k, n, dtype_bytes)


def float8_gemm_time(hw: Hardware, m: Num, k: Num, n: Num, rowwise: bool = False) -> Num:
    """Seconds of one float8 linear's GEMM (torchao's float8 matmul, 1-byte operands): at the fp8 peak and table, or
    bf16's where the profile has no fp8 peak (Hardware.peak_note says so). rowwise: one scale per row of each operand
    (torchao's rowwise recipe; torch._scaled_mm with (m, 1) and (1, n) scales), timed by the profile's FP8_ROWWISE
    table where it has one, else as tensorwise (stack_knobs says so)."""
    if not hw.peak_flops.get("fp8"):
        return dtype_gemm_time(hw, "bf16", m, k, n, FP8_BYTES)
    table = FP8_ROWWISE if rowwise and hw.tables.gemm_table(FP8_ROWWISE) is not None else None
    return dtype_gemm_time(hw, "fp8", m, k, n, FP8_BYTES, table_key=table)


def dtype_gemm_time(hw: Hardware, dtype: str, m: Num, k: Num, n: Num, dtype_bytes: float,
                    table_key: str | None = None) -> Num:
    """Seconds of one (m, k) x (k, n) GEMM in a matmul dtype (bf16, fp16, fp8, fp32); `table_key`: gemm_efficiency's."""
    flops = 2 * m * k * n  # Narayanan 2021 Sec 5.1
    moved = (m * k + k * n + m * n) * dtype_bytes
    rate = hw.peak_of(dtype) * gemm_efficiency(hw, dtype, m, k, n, table_key)
    if dtype in hw.sustained_flops:
        rate = minimum(rate, hw.sustained_flops[dtype])
    compute = flops / rate
    memory = moved / (hw.hbm_bytes_per_s * hw.elementwise_fraction("copy"))
    if hw.tables.gemm_table(table_key or dtype) is not None:  # a measured time already holds the kernel's own floor
        return maximum(maximum(compute, memory), hw.tune.kernel_launch_s)
    return maximum(compute, memory) + hw.tune.kernel_launch_s


def attention_flops(b: Num, heads: Num, seq: Num, head_dim: Num, causal: bool = True) -> Num:
    """Forward FLOPs of one fused attention call as FlashAttention-2 counts them (halved when causal)."""
    return 4 * b * heads * seq * seq * head_dim * (0.5 if causal else 1.0)


def attention_efficiency(hw: Hardware, kernel: str, seq: Num, head_dim: Num, causal: bool = True) -> tuple[Num, Num]:
    """(forward, backward) fraction of peak of a fused attention kernel: the profile's table (the kernel, else its
    flash rows), else attention_flash_efficiency for both. flash-triton falls back to flash1 before flash: the
    FlashAttention-2 paper measures the Triton port within 10% of FlashAttention v1 (Dao 2023 Fig. 4, A100)."""
    t, scale = hw.tables.attention, hw.tune.attention_scale
    if t is not None:
        for k in dict.fromkeys((kernel, *FALLBACK.get(kernel, ()), "flash")):
            if k in t.kernels():
                if is_array(seq, head_dim):
                    # per_unique calls the lambda right here, in this iteration
                    both = per_unique(lambda a, b: t.efficiency(k, a, b, causal), seq, head_dim)  # noqa: B023
                    return both[..., 0] * scale, both[..., 1] * scale
                fwd, bwd = t.efficiency(k, seq, head_dim, causal)
                return fwd * scale, bwd * scale
    e = hw.tune.attention_flash_efficiency * scale
    return e, e


def attention_time(hw: Hardware, precision: str, kernel: str, b: Num, heads: Num, seq: Num, head_dim: Num,
                   causal: bool = True) -> tuple[Num, Num]:
    """(forward, backward) seconds of one fused attention call on one rank (module docstring)."""
    peak = hw.peak_of(PRECISION_DTYPE.get(str(precision), "fp32"))
    fwd_eff, bwd_eff = attention_efficiency(hw, kernel, seq, head_dim, causal)
    flops = attention_flops(b, heads, seq, head_dim, causal)
    floor = hw.tune.kernel_launch_s
    return maximum(flops / (peak * fwd_eff), floor), maximum(FLASH_BWD_FACTOR * flops / (peak * bwd_eff), floor)


def passes_time(hw: Hardware, passes: list[Pass]) -> Num:
    """Seconds of memory-bound kernels: each max(bytes / class bandwidth, kernel floor), times its count."""
    total: Num = 0.0
    floor = hw.tune.kernel_launch_s
    for p in passes:
        if isinstance(p.count, (int, float)) and p.count == 0:
            continue
        total = total + p.count * maximum(p.bytes / (hw.hbm_bytes_per_s * hw.elementwise_fraction(p.cls)), floor)
    return total


def optimizer_time(hw: Hardware, elements: Num, implementation: str, per_element_bytes: float = ADAMW_BYTES_PER_PARAM,
                   kernels: int = 0) -> Num:
    """Seconds of an optimizer step over `elements` fp32 elements: the implementation's measured fraction of the HBM
    peak (foreach: torch's default on CUDA; fused), else memory_efficiency; plus `kernels` kernel floors."""
    fraction = hw.tables.optimizer.get(implementation) or hw.tune.memory_efficiency
    return per_element_bytes * elements / (hw.hbm_bytes_per_s * fraction * hw.tune.optimizer_scale) \
        + kernels * hw.tune.kernel_launch_s
