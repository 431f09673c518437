"""Seconds of torchao's float8 casts around each float8 linear's GEMMs: the amax reductions and the bf16 -> fp8 casts of
its input, weight and output gradient (pure Python). The GEMMs themselves are ops.float8_gemm_time.

Kernel by kernel as torchao's own roofline counts them (pytorch/ao 0598012, torchao/testing/training/roofline_utils.py,
get_tensor_memory_traffic_ovhd_s and get_float8_mem_sympy): each kernel moves its bytes at the profile's copy bandwidth,
never under one kernel floor. Per element of the cast tensor:
- tensorwise, input and grad_output: amax 2 B read (0 when torch.compile fuses it into the producing op), a second
  amax stage (a floor), the cast 2 B read + 1 B written twice (row- and column-major copies);
  weight: amax 2 B, the second stage, a 2 + 1 B cast in forward and another in backward.
- rowwise, input and grad_output: 2 + 1 + 2 B (its fp8 rows and a bf16 transpose; 1 + 2 B fused) then 2 + 1 B;
  weight: 2 + 1 B in forward, a 2 + 2 B transpose and a 2 + 1 B cast in backward.
- compiled ("compiled" element-wise, torchao's enable_fusion_modeling): input and grad_output casts fuse their
  first read with the op before them.
FSDP2's fp8 all-gather (train.fp8_gathers, tensorwise) replaces the weight's casts: fsdp_pre_all_gather casts the
dp x cp shard (2 + 1 B per shard element, per all-gather: forward, and ZeRO-3's backward re-gather), and backward's
`preprocess_addmm` copies the gathered row-major fp8 weight to column-major (1 + 1 B; torchao float8_ops.py).
The scale all-reduce is traffic.dp_traffic's.
Under TP, torchao's float8 TP styles (tensorwise: torchtitan's enable_float8_tensorwise_tp; pytorch/ao 0e0fba8
torchao/float8/float8_tensor_parallel.py) cast before the collective: PrepareFloat8ModuleInput casts the attention's
and the MLP's input once for all the colwise linears it feeds (q, k, v; gate, up), and Float8RowwiseParallel casts the
output gradient of o / down after its redistribute, both on the activations as they arrive: rows / tp under sequence
parallelism. The colwise linears' output gradients and the rowwise linears' inputs are the GEMMs' own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.analytic.scalar_or_array import maximum
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.stack_kernels import TORCHAO_ROWWISE
from backend.analytic.steptime.torchao_rowwise import TORCHAO_ROWWISE_LINEAR
from backend.analytic.tp_placement import BLOCK_INPUT_LINEAR, OUTPUT_PROJECTION

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec

BF16, FP8 = 2, 1
"""Bytes per element of a cast's bf16 source and fp8 result."""


@dataclass(frozen=True)
class CastRole:
    """Where a float8 linear sits in the TP plan: fed by its module's input (`fed_by`: how many float8 linears share
    that input's one cast), an output projection, or neither (every linear without TP)."""

    module_input: bool = False
    fed_by: int = 1
    output_projection: bool = False


OUTSIDE_TP_PLAN = CastRole()
"""A linear the float8 TP styles do not place (and every linear without TP)."""


def cast_roles(names: list[str]) -> dict[str, CastRole]:
    """The CastRole of each float8 linear weight name of a stage (module docstring)."""
    siblings: dict[str, int] = {}
    for name in names:
        if BLOCK_INPUT_LINEAR.fullmatch(name):
            module = name.rsplit(".", 2)[0]
            siblings[module] = siblings.get(module, 0) + 1
    roles = {}
    for name in names:
        if BLOCK_INPUT_LINEAR.fullmatch(name):
            roles[name] = CastRole(module_input=True, fed_by=siblings[name.rsplit(".", 2)[0]])
        else:
            roles[name] = CastRole(output_projection=bool(OUTPUT_PROJECTION.fullmatch(name)))
    return roles


def _activation_kernels(rowwise: bool, compiled: bool) -> tuple[float, ...]:
    """Bytes per element of each kernel casting an input or output gradient (module docstring)."""
    if rowwise:
        return ((0 if compiled else BF16) + FP8 + BF16, BF16 + FP8)
    return (0 if compiled else BF16, 0, BF16 + 2 * FP8)


def _weight_kernels(rowwise: bool) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(forward, backward) bytes per weight element of each kernel casting a weight without fp8 all-gather."""
    if rowwise:
        return (BF16 + FP8,), (2 * BF16, BF16 + FP8)
    return (BF16, 0, BF16 + FP8), (BF16 + FP8,)


def _kernels_s(hw: Hardware, per_element: tuple[float, ...], elements: float) -> float:
    """Seconds of kernels moving `per_element` bytes each over `elements` elements, each at least one kernel floor."""
    bandwidth = hw.hbm_bytes_per_s * hw.elementwise_fraction("copy")
    return sum(float(maximum(b * elements / bandwidth, hw.tune.kernel_launch_s)) for b in per_element)


def float8_casts_s(hw: Hardware, spec: ExperimentSpec, fp8_gemms: str, compiled: bool,
                   gemm: tuple[float, int, int], role: CastRole = OUTSIDE_TP_PLAN) -> tuple[float, float]:
    """(forward, backward) seconds of the casts around one torchao float8 linear; `gemm`: (rows, k, n_out) of its
    forward GEMM (fp8_gemms: "torchao" tensorwise or TORCHAO_ROWWISE), `role`: its place in the TP plan."""
    rows, k, n_out = gemm
    rowwise = fp8_gemms == TORCHAO_ROWWISE
    p = spec.parallel
    float8_tp = not rowwise and p.tp > 1
    arriving = rows / p.tp if float8_tp and p.sequence_parallel else rows
    act = _activation_kernels(rowwise, compiled)
    if float8_tp and role.module_input:
        fwd = _kernels_s(hw, act, arriving * k) / role.fed_by
    else:
        fwd = _kernels_s(hw, act, rows * k)
    bwd = _kernels_s(hw, act, (arriving if float8_tp and role.output_projection else rows) * n_out)
    weight = k * n_out
    if spec.train.fp8_gathers and p.zero_stage >= 2 and p.dp_cp > 1:
        shard = weight / p.dp_cp
        fwd += _kernels_s(hw, (BF16 + FP8,), shard)
        bwd += _kernels_s(hw, (2 * FP8,), weight)
        if p.zero_stage == 3:
            bwd += _kernels_s(hw, (BF16 + FP8,), shard)
        return fwd, bwd
    w_fwd, w_bwd = _weight_kernels(rowwise)
    return fwd + _kernels_s(hw, w_fwd, weight), bwd + _kernels_s(hw, w_bwd, weight)


def float8_casts_cost(hw: Hardware, spec: ExperimentSpec, weights: tuple[tuple[tuple, ...], tuple[int, ...]],
                      tokens: int, fp8_gemms: str, compiled: bool) -> tuple[float, float]:
    """(forward, backward) seconds of the casts around every float8 linear among `weights` (compute.weight_kinds: a
    float8 kind carries its CastRole; float8 linears are never experts, so each sees `tokens` rows); Transformer
    Engine's fp8 (fp8_gemms "transformer_engine") casts inside its fused modules, and a compiled rowwise linear timed
    whole (TORCHAO_ROWWISE_LINEAR) has its casts in its measured time: neither is counted here."""
    if fp8_gemms in ("transformer_engine", TORCHAO_ROWWISE_LINEAR):
        return 0.0, 0.0
    context = casts_context(spec, fp8_gemms, compiled)
    fwd = bwd = 0.0
    for i in weights[1]:
        (n_out, k), _, float8, role = weights[0][i]
        if not float8:
            continue
        key = ("float8 casts", tokens, k, n_out, role, *context)
        timed = hw.memo.get(key)
        if timed is None:
            timed = hw.memo[key] = float8_casts_s(hw, spec, fp8_gemms, compiled, (tokens, k, n_out), role)
        fwd += timed[0]
        bwd += timed[1]
    return fwd, bwd


def casts_context(spec: ExperimentSpec, fp8_gemms: str, compiled: bool) -> tuple:
    """Everything of a spec besides a linear's shape, rows and role that float8_casts_s reads (its memo keys)."""
    p = spec.parallel
    return fp8_gemms, compiled, spec.train.fp8_gathers, p.zero_stage, p.dp_cp, p.tp, p.sequence_parallel
