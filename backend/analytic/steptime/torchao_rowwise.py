"""A torchao rowwise float8 linear under torch.compile, timed from torchao's own microbenchmark of it (pure Python +
numpy): its three GEMMs and every amax and cast around them together, without a kernel-level model of the casts.

The table: pytorch/ao fdddb2cf (2025-06-06), torchao/float8/README.md "Rowwise scaling", docs/static/
fp8-rowwise-perf.png: "Speedup observed vs bfloat16 for LayerNorm -> Linear -> Sigmoid fwd + bwd by forward M, K, N,
dynamic row-wise scaling, PyTorch version 2.8.0a0+git48807d5", NVIDIA H100. It was made by benchmarks/float8/
float8_roofline.py at that commit (`--float8_recipe_name rowwise`, fusion modeling on): LNLinearSigmoid (LayerNorm
without affine, Linear without bias, Sigmoid), compiled, bf16 against Float8LinearConfig.from_recipe_name("rowwise"),
the sum of GPU kernel times of a forward and backward. The script defines the speedup as
(ln + bf16 GEMMs + sigmoid) / (ln + fp8 GEMMs + fp8 overhead + sigmoid), so a float8 linear costs its bf16 GEMMs plus
(that bf16 chain) x (1 / speedup - 1). The chain is timed on the profile at hand (its bf16 GEMM table; the norm's and
the sigmoid's passes, 4 + 6 B per element each, at its copy bandwidth), so what carries over from the H100 is the ratio.
The extra seconds are shared among forward, dgrad and wgrad as their bf16 GEMMs are.

Shapes outside the table's 1024..32768 grid take its edge: the k and v projections of a tensor-parallel block
(N = 1024 / tp) are narrower than any row, and the table's narrowest column is already its slowest (0.4-0.6).
Why this matters: torchtitan #1207 (2025-06) traced the flat throughput of rowwise float8 with vanilla TP to exactly
those small linears (~40% slower than bf16), before torchao's auto filter (pytorch/ao #2410) left them in bf16.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.scalar_or_array import maximum
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.ops import dtype_gemm_time
from backend.analytic.steptime.stack_kernels import TORCHAO_ROWWISE

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num

TORCHAO_ROWWISE_LINEAR = "torchao-rowwise-linear"
"""StackKnobs.fp8_gemms of torchao's rowwise recipe under torch.compile on Hopper, where no measured rowwise GEMM
table of the profile's own is there: each float8 linear is timed whole by this module (its casts included)."""
ROWWISE_GEMMS = (TORCHAO_ROWWISE, TORCHAO_ROWWISE_LINEAR)
"""The fp8_gemms of torchao's rowwise recipe, however timed: each float8 linear quantizes its own input per row."""
GRID = (1024, 2048, 4096, 8192, 16384, 32768)
"""M (forward rows), K and N: the table's axes."""
SPEEDUP = (  # [M][K][N], N across: 1024 .. 32768
    ((0.42, 0.42, 0.50, 0.51, 0.56, 0.56), (0.40, 0.38, 0.42, 0.50, 0.50, 0.56), (0.48, 0.43, 0.46, 0.53, 0.57, 0.60),
     (0.45, 0.48, 0.54, 0.62, 0.60, 0.62), (0.46, 0.48, 0.54, 0.60, 0.60, 0.61), (0.45, 0.50, 0.55, 0.60, 0.62, 0.65)),
    ((0.43, 0.43, 0.48, 0.55, 0.62, 0.65), (0.38, 0.45, 0.58, 0.65, 0.72, 0.75), (0.43, 0.50, 0.68, 0.78, 0.81, 0.82),
     (0.46, 0.58, 0.73, 0.82, 0.87, 0.89), (0.48, 0.62, 0.75, 0.83, 0.84, 0.85), (0.50, 0.64, 0.75, 0.84, 0.83, 0.99)),
    ((0.45, 0.47, 0.57, 0.66, 0.72, 0.76), (0.43, 0.53, 0.70, 0.83, 0.90, 0.91), (0.44, 0.64, 0.84, 1.01, 1.01, 1.04),
     (0.53, 0.72, 0.91, 1.01, 1.07, 1.13), (0.53, 0.74, 0.92, 1.05, 1.10, 1.18), (0.54, 0.75, 0.93, 1.02, 1.17, 1.18)),
    ((0.48, 0.52, 0.65, 0.77, 0.83, 0.84), (0.45, 0.64, 0.82, 1.01, 1.03, 1.06), (0.52, 0.76, 1.00, 1.13, 1.17, 1.19),
     (0.59, 0.85, 1.05, 1.20, 1.31, 1.41), (0.58, 0.82, 1.03, 1.22, 1.37, 1.40), (0.59, 0.82, 1.04, 1.30, 1.36, 1.46)),
    ((0.48, 0.58, 0.73, 0.86, 0.85, 0.89), (0.51, 0.70, 0.90, 1.05, 1.07, 1.15), (0.57, 0.79, 1.02, 1.20, 1.26, 1.40),
     (0.61, 0.87, 1.08, 1.33, 1.39, 1.49), (0.59, 0.83, 1.07, 1.34, 1.42, 1.55), (0.60, 0.85, 1.16, 1.35, 1.48, 1.72)),
    ((0.51, 0.62, 0.77, 0.87, 0.88, 0.94), (0.54, 0.73, 0.91, 1.08, 1.14, 1.27), (0.59, 0.81, 1.04, 1.28, 1.35, 1.49),
     (0.63, 0.87, 1.11, 1.41, 1.50, 1.62), (0.60, 0.83, 1.16, 1.39, 1.49, 1.73), (0.63, 0.93, 1.16, 1.48, 1.70, 1.52)),
)
_TABLE = np.array(SPEEDUP, dtype=np.float64)
_LOG_GRID = np.log2(np.array(GRID, dtype=np.float64))
LN_BYTES, SIGMOID_BYTES = (4, 6), (4, 6)
"""(forward, backward) bytes per element of the benchmark's LayerNorm (over M x K) and Sigmoid (over M x N), bf16:
read and write in forward; read the saved tensor and the gradient, write the input's gradient in backward."""


def _axis(x: Num) -> tuple[np.ndarray, np.ndarray]:
    """(lower grid index, weight of the upper one) of x on the table's log2 axis, clamped to its ends."""
    pos = np.interp(np.log2(np.maximum(np.asarray(x, dtype=np.float64), 1.0)), _LOG_GRID, np.arange(len(GRID)))
    lower = np.minimum(np.floor(pos).astype(int), len(GRID) - 2)
    return lower, pos - lower


def rowwise_speedup(m: Num, k: Num, n: Num) -> Num:
    """The table's speedup at (m, k, n), trilinear in log2 of each axis, clamped to the grid (scalars or arrays)."""
    (im, wm), (ik, wk), (i_n, wn) = _axis(m), _axis(k), _axis(n)
    out = 0.0
    for dm, fm in ((0, 1 - wm), (1, wm)):
        for dk, fk in ((0, 1 - wk), (1, wk)):
            for dn, fn in ((0, 1 - wn), (1, wn)):
                out = out + fm * fk * fn * _TABLE[im + dm, ik + dk, i_n + dn]
    return float(out) if np.ndim(out) == 0 else out


def rowwise_linear_s(hw: Hardware, rows: Num, k: Num, n_out: Num) -> tuple[Num, Num, Num]:
    """(forward, dgrad, wgrad) seconds of one compiled rowwise float8 linear of forward shape (rows, k) x (k, n_out),
    its casts included (module docstring)."""
    gemms = (dtype_gemm_time(hw, "bf16", rows, k, n_out, 2), dtype_gemm_time(hw, "bf16", rows, n_out, k, 2),
             dtype_gemm_time(hw, "bf16", k, rows, n_out, 2))
    bandwidth = hw.hbm_bytes_per_s * hw.elementwise_fraction("copy")
    passes = sum(maximum(b * rows * width / bandwidth, hw.tune.kernel_launch_s)
                 for b_pair, width in ((LN_BYTES, k), (SIGMOID_BYTES, n_out)) for b in b_pair)
    gemm_total = gemms[0] + gemms[1] + gemms[2]
    extra = (gemm_total + passes) * (1.0 / rowwise_speedup(rows, k, n_out) - 1.0)
    return tuple(g + extra * g / gemm_total for g in gemms)  # type: ignore[return-value]
