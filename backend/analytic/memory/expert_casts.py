"""What autocast's 16-bit weight copies leave out of an MoE block when its experts run as grouped GEMMs
(ModelSpec.moe_grouped_gemm; models/grouped_experts.GroupedLinear).

GroupedLinear casts the local experts' weights and biases inside its own autograd Function, stacks them for one
grouped matmul and drops the stack; it saves the fp32 weights themselves and stacks them again in backward. So no
16-bit expert weight or bias lives in autocast's cache or among the saved tensors, where the per-expert loop's
F.linear keeps one per Linear. The grouped path runs only where `grouped_experts.grouped_reason` lets it: plain (not
tensor-parallel, not float8) experts whose in and out features fill whole 16-byte rows in the compute dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.layout import Layout
from backend.analytic.params import expert_ffn, is_gated
from backend.analytic.scalar_or_array import logical_and, where

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

ROW_STRIDE_BYTES = 16
"""grouped_mm's row stride (models/grouped_experts.STRIDE_BYTES)."""


def grouped_expert_elems(model: ModelSpec, layout: Layout) -> tuple[Num, Num]:
    """(weight, bias) elements of one MoE block's local experts that keep no 16-bit copy (module docstring); (0, 0)
    where the per-expert loop runs."""
    if not model.is_moe or not getattr(model, "moe_grouped_gemm", False):
        return 0.0, 0.0
    h, f, cb = model.d_model, expert_ffn(model), layout.compute_bytes
    gated = is_gated(str(model.mlp))
    plain = where(layout.ep > 1, layout.etp == 1, layout.tp == 1)
    rows_fit = logical_and((h * cb) % ROW_STRIDE_BYTES == 0, (f * cb) % ROW_STRIDE_BYTES == 0)
    runs = logical_and(logical_and(plain, rows_fit), layout.precision != "fp8")
    local = model.n_experts / layout.ep
    weights = local * (3 if gated else 2) * h * f
    biases = local * ((2 * f + h) if gated else (f + h)) if str(model.bias) == "all" else 0
    return where(runs, weights, 0), where(runs, biases, 0)

