"""A rank's local experts as one grouped GEMM per expert weight (Megatron-Core's --moe-grouped-gemm, TEGroupedMLP;
torchtitan's `_run_experts_grouped_mm`, torchtitan/models/moe/moe.py @ v0.2.2 l. 113-130).

The rows arrive sorted by local expert (`counts[j]` rows for expert j). Each Linear of the expert MLP (fc_in / fc_out,
or gate / up / down) becomes one `torch.nn.functional.grouped_mm` over all local experts: torch 2.13 has no CPU kernel
of its own and runs `_grouped_mm_fallback`, one `mm` per group (aten GroupedMMUtils.h @ f2c5a6cb), so on the CPU this
saves Python dispatch, not FLOPs. Its rules (validated in aten Blas.cpp `_grouped_mm_validate_inputs` @ 017943b7,
checked on the 2.13 wheel: /work/wt/research/moe.md Sec 4.3): float32 / bfloat16 / float16 only, int32 cumulative
offsets, no bias, strides of 16 bytes (in and out features a multiple of 16 / element bytes), and a backward that
rejects expanded (stride-0) gradients. `grouped_reason` says why a layer keeps the per-expert loop instead.

`GroupedLinear` is its own autograd Function so the stacked weights are not saved for backward: the forward stacks
the experts' (out, in) weights into one (G, in, out) operand, the backward stacks them again. It saves what the
per-expert Linears save (the input rows in the compute dtype), not a second copy of every local expert's weights.
Under autocast it computes in the autocast dtype as F.linear does (inputs and weights cast, output in that dtype,
weight gradients returned in the parameters' dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.spec import Mlp

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STRIDE_BYTES = 16
CLAMP_LIMIT, CLAMP_ALPHA = 7.0, 1.702  # gpt.ClampedSwiGLU's constants (gpt-oss); tests/unit/test_grouped_experts.py
GATED = {Mlp.SWIGLU, Mlp.GEGLU, Mlp.SWIGLU_CLAMPED}


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the Linears compute in here: the autocast dtype when autocast is on for x's device, else x's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def linear_names(mlp: Mlp) -> tuple[str, ...]:
    return ("gate", "up", "down") if Mlp(mlp) in GATED else ("fc_in", "fc_out")


def grouped_reason(mlp: Mlp, experts: list[nn.Module], dtype: torch.dtype) -> str | None:
    """Why these experts cannot run as grouped GEMMs in `dtype` (None: they can)."""
    if dtype not in GROUPED_DTYPES:
        return f"grouped_mm takes float32, bfloat16 or float16 (got {dtype})"
    for name in linear_names(mlp):
        lin = getattr(experts[0], name)
        if type(lin) is not nn.Linear:
            return f"{name} is a {type(lin).__name__}, not a plain Linear (float8 / tensor-parallel experts)"
        if hasattr(lin.weight, "placements"):
            return f"{name}.weight is a DTensor (tensor-parallel experts): grouped_mm takes plain tensors"
        size = torch.tensor([], dtype=dtype).element_size()
        for what, n in (("in", lin.in_features), ("out", lin.out_features)):
            if n * size % STRIDE_BYTES:
                return (f"{name}'s {what}_features={n} x {size} B = {n * size} B is not a multiple of {STRIDE_BYTES} B "
                        "(grouped_mm's row stride)")
    return None


class GroupedLinear(torch.autograd.Function):
    """y[rows of group g] = x[rows of g] @ W_g^T (+ b_g), W_g the (out, in) weight of local expert g."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype, n: int, zero_empty: bool,
                *params: torch.Tensor):
        weights, biases = params[:n], params[n:]
        xd = x.to(dtype).contiguous()
        with torch.no_grad():
            w = torch.stack([q.to(dtype) for q in weights]).transpose(-2, -1)  # (G, in, out)
            y = F.grouped_mm(xd, w, offs=offs)
            del w
            if biases:
                y += torch.stack([b.to(dtype) for b in biases]).repeat_interleave(_sizes(offs), dim=0,
                                                                                   output_size=x.shape[0])
        ctx.save_for_backward(xd, offs, *weights)
        ctx.n, ctx.biased, ctx.x_dtype, ctx.zero_empty = n, bool(biases), x.dtype, zero_empty
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xd, offs, *weights = ctx.saved_tensors
        grad = grad.to(xd.dtype).contiguous()  # grouped_mm rejects expanded (stride-0) gradients
        w = torch.stack([q.to(xd.dtype) for q in weights])  # (G, out, in)
        grad_x = F.grouped_mm(grad, w, offs=offs).to(ctx.x_dtype)
        del w
        grad_w = F.grouped_mm(grad.t(), xd, offs=offs)  # (G, out, in): groups along the rows (K)
        grads = [g.to(q.dtype) for g, q in zip(grad_w.unbind(0), weights, strict=False)]
        if ctx.biased:
            sums = torch.zeros(len(weights), grad.shape[1], dtype=torch.float32, device=grad.device)
            sums.index_add_(0, _group_ids(offs, grad.shape[0]), grad.float())
            grads += [s.to(q.dtype) for s, q in zip(sums.unbind(0), weights, strict=False)]
        if not ctx.zero_empty:  # an expert no row reached keeps grad None, as its Linear would (ExpertUsage)
            empty = (_sizes(offs) == 0).tolist()
            grads = [None if empty[i % len(weights)] else g for i, g in enumerate(grads)]
        return (grad_x, None, None, None, None, *grads)


def _sizes(offs: torch.Tensor) -> torch.Tensor:
    return torch.diff(offs, prepend=offs.new_zeros(1)).long()


def _group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(offs), device=offs.device), _sizes(offs), output_size=rows)


def grouped_linear(x: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype, linears: list[nn.Linear],
                   zero_empty: bool = False) -> torch.Tensor:
    """zero_empty: experts no row reached get zero gradients (the data-parallel reducers need every grad), else None."""
    weights = [lin.weight for lin in linears]
    biases = [lin.bias for lin in linears if lin.bias is not None]
    return GroupedLinear.apply(x, offs, dtype, len(weights), zero_empty, *weights, *biases)


def activation(mlp: Mlp, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    """The expert MLP's element-wise middle, as backend/models/gpt.py's MLP classes compute it."""
    kind = Mlp(mlp)
    if kind == Mlp.GELU:
        return F.gelu(gate)
    if kind == Mlp.SWIGLU:
        return F.silu(gate) * up
    if kind == Mlp.GEGLU:
        return F.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=CLAMP_LIMIT)
    up = up.clamp(-CLAMP_LIMIT, CLAMP_LIMIT)
    return gate * torch.sigmoid(gate * CLAMP_ALPHA) * (up + 1)


def run_grouped(mlp: Mlp, experts: list[nn.Module], x: torch.Tensor, counts: torch.Tensor,
                zero_empty: bool = False) -> torch.Tensor:
    """The experts' outputs for rows `x` sorted by expert (counts[j] rows for experts[j]), in the compute dtype."""
    dtype = compute_dtype(x)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    names = linear_names(mlp)

    def linear(inp: torch.Tensor, name: str) -> torch.Tensor:
        return grouped_linear(inp, offs, dtype, [getattr(e, name) for e in experts], zero_empty)

    first = linear(x, names[0])
    up = linear(x, names[1]) if len(names) == 3 else None
    return linear(activation(mlp, x, first, up), names[-1])
