"""Memory-bound work of a training step, kernel by kernel: the element-wise passes of one transformer layer, the
per-microbatch parameter passes of mixed precision, the loss, the optimizer step (pure Python + numpy).

Two implementations (`IMPLEMENTATIONS`, chosen per profile by compute.default_implementation or per call):
- "torch": eager PyTorch, one kernel per operator, as ShardLab's engine runs (backend/models/gpt.py under
  strategies/step.py) and as PyTorch-native trainers do. The passes below are counted from gpt.py's forward and
  from autograd's backward of it; bytes = what each kernel must read and write.
  Under autocast (every layout but pure ZeRO-2/3, which casts with FSDP2's MixedPrecisionPolicy) the parameters
  and the residual stream stay fp32: norms run in fp32, every Linear casts its input (q, k, v, gate, up, fc_in)
  and its weight to 16 bit per microbatch, and backward casts each weight's gradient back and accumulates it
  into the persistent fp32 .grad (zero_grad(set_to_none=False)).
- "fused": Megatron-LM's fused kernels (Narayanan et al. 2021 Sec 4.2: fused bias+GeLU, bias+dropout+add,
  scale+mask+softmax; 16-bit residual stream; gradient accumulation fused into the weight-gradient GEMM): each
  activation of Korthikanti 2022 Table 2 written once and read once in forward, backward twice that.

- "compiled": torch.compile of each block (torchtitan's apply_compile, models/llama3/infra/parallelize.py 256-269
  @e347b1e: `torch.compile(transformer_block, fullgraph=True)`): inductor fuses every chain of point-wise and
  reduction operators between two extern kernels (matmuls, SDPA) into one kernel that reads the chain's inputs once
  and writes its outputs once (`compiled_layer_passes`). The per-microbatch parameter passes stay as "torch"'s.
  No published kernel table compares compiled with eager element-wise kernels (research notes, gap 7): the fused
  kernels are timed at the same measured per-class bandwidths as the eager ones, so what compile changes is the
  bytes and the kernel count, counted from the block's operators.

Each kernel takes max(bytes / (HBM peak x its class's measured fraction), the device's kernel floor): small
kernels cost their launch floor, large ones their traffic (Williams et al. 2009, "Roofline", Sec 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.analytic.scalar_or_array import maximum
from backend.spec.choices import GATED_MLPS, Mlp, Norm, Positions

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

IMPLEMENTATIONS = ("torch", "fused", "compiled")
CE_FWD_BYTES_PER_LOGIT = 8
CE_BWD_BYTES_PER_LOGIT = 12
"""Cross-entropy over fp32 logits: forward reads the logits and writes the log-softmax (8 B), backward reads
log-softmax and the upstream gradient and writes the logits' gradient (12 B): the probe's 20 B per logit."""
CAST_BYTES = 6
"""fp32 -> 16-bit cast of one element: read 4, write 2 (and back in backward)."""
ACCUMULATE_BYTES = 12
"""grad += new (fp32): read 4 + 4, write 4."""


@dataclass(frozen=True)
class Pass:
    """One kernel (or `count` kernels of the same size) of a microbatch."""

    cls: str
    """Bandwidth class (op_tables.ELEMENTWISE_CLASSES): copy, rmsnorm, layernorm, swiglu, gelu, cross_entropy."""
    bytes: Num
    count: Num = 1
    """Kernels of this size (an array where the kernel runs in some layouts only)."""


@dataclass(frozen=True)
class Widths:
    """Per-rank sizes of one layer and microbatch (scalars or arrays)."""

    tokens: Num
    """Tokens through the attention and MLP of this rank (b·s)."""
    norm_tokens: Num
    """Tokens of the norm / residual regions (b·s/tp under sequence parallelism)."""
    h: int
    q: Num
    """Local query width: heads/tp x head_dim."""
    kv: Num
    ffn: Num
    act: float
    """Bytes of a 16-bit (or fp32) activation."""
    residual: float
    """Bytes of the residual stream and the norms' output (fp32 under autocast)."""


def layer_passes(model: ModelSpec, w: Widths) -> tuple[list[Pass], list[Pass]]:
    """(forward, backward) kernels of one layer of ShardLab's GPT in eager PyTorch (module docstring)."""
    norm = "rmsnorm" if model.norm == Norm.RMSNORM else "layernorm"
    swiglu = model.mlp == Mlp.SWIGLU
    c, r, t, tn = w.act, w.residual, w.tokens, w.norm_tokens
    casts = r != c  # autocast: fp32 norm outputs cast to 16 bit per Linear input (an array over layouts)
    fwd, bwd = [], []
    mlp_inputs = 2 if swiglu else 1
    for inputs in (3, mlp_inputs):  # ln1 -> q, k, v; ln2 -> gate, up | fc_in
        fwd.append(Pass(norm, 2 * r * tn * w.h))
        bwd.append(Pass(norm, 3 * r * tn * w.h))
        fwd.append(Pass("copy", (r + c) * t * w.h, inputs * casts))
        bwd.append(Pass("copy", (r + c) * t * w.h, inputs * casts))
        bwd.append(Pass("copy", 3 * r * t * w.h, inputs - 1))  # the inputs' gradients summed
        fwd.append(Pass("copy", (2 * r + c) * tn * w.h))  # residual add
        bwd.append(Pass("copy", 3 * r * tn * w.h))  # the residual's two gradient paths summed
    if model.positions == Positions.ROPE:  # apply_rope: x*cos, -x2, cat, *sin, add on q and k
        for width in (w.q, w.kv):
            for units in (2, 1, 2, 2, 3):
                fwd.append(Pass("copy", units * c * t * width))
                bwd.append(Pass("copy", units * c * t * width))
    if model.kv_heads < model.n_heads:  # repeat_interleave of k and v (backward: the sum over the group)
        fwd.append(Pass("copy", c * t * (w.kv + w.q), 2))
        bwd.append(Pass("copy", c * t * (w.kv + w.q), 2))
    fwd.append(Pass("copy", 2 * c * t * w.q))  # the attention output's transpose + reshape
    bwd.append(Pass("copy", 2 * c * t * w.q))
    act = "swiglu" if swiglu else "gelu"
    if swiglu:  # silu(gate) * up
        fwd += [Pass(act, 2 * c * t * w.ffn), Pass(act, 3 * c * t * w.ffn)]
        bwd.append(Pass(act, 3 * c * t * w.ffn, 3))
    else:
        fwd.append(Pass(act, 2 * c * t * w.ffn))
        bwd.append(Pass(act, 3 * c * t * w.ffn))
    return fwd, bwd


def compiled_layer_passes(model: ModelSpec, w: Widths) -> tuple[list[Pass], list[Pass]]:
    """(forward, backward) kernels of one block under torch.compile (module docstring): the fused regions between
    its matmuls and its attention core, each reading its inputs and writing its outputs once. Forward: norm 1;
    RoPE on q and k (with the GQA repeat of k and v); the attention output's transpose; the residual add fused into
    norm 2; the gated activation (or GELU); the closing residual add. Backward: each region's gradient kernel reads
    what its forward read plus the upstream gradient and writes the gradients of its inputs (the residual stream's
    two gradient paths summed inside the norms' backward)."""
    norm = "rmsnorm" if model.norm == Norm.RMSNORM else "layernorm"
    gated = model.mlp in GATED_MLPS
    c, r, t, tn = w.act, w.residual, w.tokens, w.norm_tokens
    fwd = [Pass(norm, (r + c) * tn * w.h),  # x -> ln1(x)
           Pass("copy", (2 * r + 2 * c) * tn * w.h),  # x + attn_out -> h, ln2(h): the add inside norm 2's kernel
           Pass("copy", (2 * r + c) * tn * w.h),  # h + mlp_out
           Pass("copy", 2 * c * t * w.q)]  # the attention output's transpose + reshape
    bwd = [Pass(norm, (2 * r + 2 * c) * tn * w.h),  # ln1: read x, dy, the residual grad; write dx
           Pass(norm, (3 * r + 2 * c) * tn * w.h),  # ln2 with the add: read h, dy, d_out; write dh, d_attn_out
           Pass("copy", 2 * c * t * w.q)]
    rope = model.positions == Positions.ROPE
    repeat = model.kv_heads < model.n_heads
    if rope or repeat:  # one kernel: RoPE on q and k, k and v repeated to the q heads; reads the projections it
        read = (w.q if rope else 0) + (2 * w.kv if repeat else w.kv)  # needs, writes SDPA's inputs
        written = (w.q if rope else 0) + (2 * w.q if repeat else w.kv)
        fwd.append(Pass("copy", c * t * (read + written)))
        bwd.append(Pass("copy", c * t * (read + written)))
    if gated:  # act(gate) * up: read gate, up, write the product; backward reads both and d, writes d_gate, d_up
        fwd.append(Pass("swiglu", 3 * c * t * w.ffn))
        bwd.append(Pass("swiglu", 5 * c * t * w.ffn))
    else:
        fwd.append(Pass("gelu", 2 * c * t * w.ffn))
        bwd.append(Pass("gelu", 3 * c * t * w.ffn))
    return fwd, bwd


def fused_layer_passes(korthikanti_bytes: Num, act_bytes: float) -> tuple[Pass, Pass]:
    """(forward, backward) of a fused layer: Korthikanti 2022 Table 2's activations (16-bit units, without the
    5as²b scores counted with the attention) written once and read once over 12 kernels, backward twice that.
    `bytes` is the total over the `count` kernels (compute.memory_s adds one floor per kernel)."""
    f = 2 * korthikanti_bytes * act_bytes / 2
    return Pass("copy", f, 12), Pass("copy", 2 * f, 24)


def param_passes(gemm_numel: Num, other_numel: Num, n_gemm: Num, n_other: Num, autocast: Num
                 ) -> tuple[list[Pass], list[Pass]]:
    """(forward, backward) per-microbatch passes over one stage's parameters under autocast (module docstring):
    each GEMM weight cast to 16 bit in forward; in backward its gradient cast back and accumulated into .grad,
    the other parameters' gradients accumulated. Nothing without autocast (FSDP2 casts in its copy-in);
    `autocast` may be an array over layouts. Tensor sizes are the stage's mean per tensor."""
    g_each, o_each = gemm_numel / maximum(n_gemm, 1), other_numel / maximum(n_other, 1)
    fwd = [Pass("copy", CAST_BYTES * g_each, n_gemm * autocast)]
    bwd = [Pass("copy", CAST_BYTES * g_each, n_gemm * autocast),
           Pass("copy", ACCUMULATE_BYTES * g_each, n_gemm * autocast),
           Pass("copy", ACCUMULATE_BYTES * o_each, n_other * autocast)]
    return fwd, bwd
