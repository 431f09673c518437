"""Kernels a stack runs that ShardLab's own engine does not, timed from published kernel benchmarks (pure Python).

- Transformer Engine's fp8 GEMMs (Megatron-Core under --fp8-format, the `transformer_engine` fp8_gemms of
  spec/stacks.ResolvedStack): NVIDIA's TE GEMM profiling guide measures, per pass of a transformer layer's four linear
  layers, the BF16 and the FP8 GEMM time in TE's autocast (quantization included) on an H200 NVL (Hopper).
  A TE fp8 GEMM takes the profile's own bf16 GEMM time of that shape divided by TE's measured fp8 speedup for its pass
  (fprop, dgrad, wgrad), delayed scaling (Megatron's default --fp8-recipe): the ratio is the transferable part (the NVL
  part's clocks differ from an SXM's; research notes Sec 6.4). The guide's shapes are M = 15,872 tokens against
  4096-wide layers; small GEMMs gain less ("attn out ... may see little benefit"), which one ratio per pass does not
  resolve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.ops import dtype_gemm_time

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num

TORCHAO_ROWWISE = "torchao-rowwise"
"""StackKnobs.fp8_gemms of torchao's rowwise recipe (Float8LinearConfig.from_recipe_name("rowwise")): its GEMMs scale
each row of both operands (ops.float8_gemm_time rowwise)."""
TE_FP8_GEMM_MS = {
    "source": "NVIDIA TransformerEngine docs/examples/gemm_profiling/gemm_profiling.rst (d0067d0d, lines 233-300; the "
              "same text at 8f2e6357), 'Worked Example: 5B Model on H200': GEMM Benchmark (Model Config Mode) on "
              "NVIDIA H200 NVL, Autocast (includes quantization overhead), hidden 4096, intermediate 16384, MBS 31 x "
              "seq 512, per-layer GEMM time in ms",
    "bf16": {"fprop": 10.653, "dgrad": 10.813, "wgrad": 10.548},
    "fp8_delayed": {"fprop": 6.188, "dgrad": 6.306, "wgrad": 6.484},
    "fp8_current": {"fprop": 6.503, "dgrad": 6.795, "wgrad": 6.987},
}
"""The published per-layer times each ratio below is read from (ms per layer, per pass)."""
TE_FP8_SPEEDUP = {p: TE_FP8_GEMM_MS["bf16"][p] / TE_FP8_GEMM_MS["fp8_delayed"][p] for p in ("fprop", "dgrad", "wgrad")}
"""BF16 over FP8 delayed-scaling time per pass: fprop 1.722, dgrad 1.715, wgrad 1.627."""


def te_float8_gemm_time(hw: Hardware, gemm_pass: str, m: Num, k: Num, n: Num) -> Num:
    """Seconds of one Transformer Engine fp8 GEMM of `gemm_pass` (fprop, dgrad, wgrad): the profile's bf16 GEMM of that
    shape at TE's measured fp8 speedup for the pass (module docstring)."""
    return dtype_gemm_time(hw, "bf16", m, k, n, 2) / TE_FP8_SPEEDUP[gemm_pass]
